"""The reference Inf2 design on CPU, so `make bench` measures it beside ours.

TorchServe's Inf2 Llama-2 streamer example (examples/large_models/inferentia2/llama/
streamer, v0.12.0): the frontend batches requests (batchSize 16, maxBatchDelay 100 ms),
ts MicroBatching splits each batch into micro-batches of 4 that run one after another,
each a `generate` feeding TextIteratorStreamerBatch whose steps go out with
send_intermediate_predict_response, and every stream of a frontend batch ends when its
last micro-batch does. transformers-neuronx is replaced by the same HF model on CPU.

Three changes so that one client measures both designs, none of them to its batching:
- NDJSON lines like ours (the example sends indented JSON without framing);
- no prompt echo (`skip_prompt`), so TTFT is the first generated text;
- `generate` runs on one long-lived thread that also loaded the model (the example
  starts a thread per micro-batch; on CPU each new thread gets its own OpenMP pool,
  which would slow the reference down for a reason that has nothing to do with it).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from ts.handler_utils.hf_batch_streamer import TextIteratorStreamerBatch
from ts.handler_utils.micro_batching import MicroBatching
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler


class ReferenceMicroBatchingHandler(BaseHandler):
    def __init__(self) -> None:
        super().__init__()
        self.handle = MicroBatching(self)

    def initialize(self, ctx: Any) -> None:
        cfg = ctx.model_yaml_config
        self.handle.micro_batch_size = int(cfg["micro_batching"]["micro_batch_size"])
        self.handle.parallelism = cfg["micro_batching"]["parallelism"]
        handler = cfg["handler"]
        self.max_new_tokens = int(handler["max_new_tokens"])
        self.generator = ThreadPoolExecutor(1, thread_name_prefix="reference-generate")
        self.generator.submit(self._load, Path(handler["checkpoint"]),
                              int(handler["threads"])).result()
        self.initialized = True

    def _load(self, path: Path, threads: int) -> None:
        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        warm = self.tokenizer(["warm up"] * self.handle.micro_batch_size, return_tensors="pt")
        self._generate(warm, None, 2)

    def _generate(self, inputs: Any, streamer: Any, new_tokens: int) -> None:
        with torch.inference_mode():
            self.model.generate(**inputs, streamer=streamer, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=self.tokenizer.eos_token_id)

    def preprocess(self, requests: list[dict]) -> tuple[int, Any]:
        prompts = []
        for req in requests:
            data = req.get("data") or req.get("body")
            if isinstance(data, (bytes, bytearray)):
                data = json.loads(data)
            prompts.append(data["prompt"])
        real = len(prompts)
        prompts += [""] * (self.handle.micro_batch_size - real)  # the compiled batch size
        return real, self.tokenizer(prompts, return_tensors="pt", padding=True)

    def inference(self, batch: tuple[int, Any]) -> list[str]:
        real, inputs = batch
        first = self.handle.get_micro_batch_idx() * self.handle.micro_batch_size
        ids = {first + i: self.context.request_ids[first + i] for i in range(real)}
        streamer = TextIteratorStreamerBatch(self.tokenizer, self.handle.micro_batch_size,
                                             skip_prompt=True, skip_special_tokens=True)
        done = self.generator.submit(self._generate, inputs, streamer, self.max_new_tokens)
        for step in streamer:
            lines = {k: json.dumps({"text": step[k - first]["text"]}) + "\n"
                     for k in ids if step[k - first]["text"]}
            if lines:
                send_intermediate_predict_response(lines, {k: ids[k] for k in lines},
                                                   "Intermediate Prediction success", 200,
                                                   self.context)
        done.result()
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        return [json.dumps({"finish_reason": "length", "prompt_tokens": prompt_tokens[i],
                            "completion_tokens": self.max_new_tokens}) + "\n"
                for i in range(real)]

    def postprocess(self, outputs: list[str]) -> list[str]:
        return outputs
