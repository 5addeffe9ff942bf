"""The page of `inf2serve chat`: Gradio's ChatInterface with a settings sidebar.

Gradio is imported inside the functions, not at module level: the 3.10 runtime check
imports every module of the package without the `chat` extra, and no other command
should pay Gradio's seconds of import time.

What the page holds is what it shows: model names and base URLs, the sampling settings, the
conversation. The token lives in `ChatBackend` in this process, which adds it to each
request; Gradio's config (the JSON the browser loads) never sees it. Streaming is an async
generator, so Gradio's stop button cancels its task, and the `async with` around the HTTP
stream in ChatBackend closes the request. A failure ends the reply with ChatBackend's
message, in the conversation under the part of the reply that arrived: a refused token, a
4xx or a dead worker reads the same in the page as in the terminal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from archive_tools.chat_client import (
    UNKNOWN_MAX_TOKENS,
    ChatBackend,
    Listing,
    PageError,
    Sampling,
    to_messages,
)

TITLE = "inf2serve chat"
#: the title of an error shown in the conversation
NOTICE = "Error:"
#: long base URLs wrap in the sidebar instead of widening it
CSS = "#chat-servers code { white-space: normal; overflow-wrap: anywhere; }"
#: how many replies stream at once (Gradio's own default for an event is 1)
CONCURRENCY = 16


def _status(listing: Listing) -> str:
    """The banner above the chat: why models are missing or a server failed, else empty."""
    if not listing.errors:
        return ""
    lines = "\n".join(f"- {e}" for e in listing.errors)
    return f"**The server did not list its models:**\n{lines}"


def _slider_end(listing: Listing, fallback: int) -> int:
    """The max-tokens slider's end: the longest context a model reports, since a reply
    cannot be longer (the server caps or refuses more); a guess when none reports one."""
    lengths = [m.max_model_len for m in listing.models if m.max_model_len]
    return max(lengths) if lengths else max(fallback, UNKNOWN_MAX_TOKENS)


def build(backend: ChatBackend, listing: Listing, sampling: Sampling, *, model: str | None = None,
          system: str = "") -> Any:
    """The page (a `gr.Blocks`), not started: `launch` starts it.

    The listing given here fills the page as first drawn; every page load lists the models
    again, so a server that came up late, a renewed token or a new model shows without a
    restart, and a failure to list shows in the banner instead of an empty picker."""
    import gradio as gr

    state = {"labels": listing.labels()}
    labels = list(state["labels"])
    end = _slider_end(listing, sampling.max_tokens)

    async def refresh(current: str | None) -> tuple[Any, Any, Any]:
        fresh = await backend.list_models()
        state["labels"] = fresh.labels()
        choices = list(state["labels"])
        keep = current if current in choices else (choices[0] if choices else None)
        return (gr.update(choices=choices, value=keep, interactive=len(choices) > 1),
                gr.update(value=_status(fresh), visible=bool(fresh.errors)),
                gr.update(maximum=_slider_end(fresh, sampling.max_tokens)))

    def notice(title: str, detail: str) -> Any:
        """A message of the page's own (titled; `detail` shows when it is opened), which
        the next turn leaves out of the conversation the model sees."""
        return gr.ChatMessage(detail, metadata={"title": title, "status": "done"})

    def failed(text: str, message: str, detail: str) -> list[Any]:
        """The reply so far and the error under it, as a notice. The event ends as a
        success, so the page leaves its streaming state (a raised gr.Error would keep the
        stop button up, which reads as a hang)."""
        return ([gr.ChatMessage(text)] if text else []) + [notice(f"{NOTICE} {message}",
                                                                  detail)]

    async def respond(message: Any, history: list[Any], label: str | None, system_prompt: str,
                      temperature: float, top_p: float, max_tokens: float
                      ) -> AsyncIterator[str | list[Any]]:
        chosen = state["labels"].get(label or "")
        if chosen is None:
            yield failed("", "no model to ask: the server listed none (the notice above the "
                         "chat says why); reload the page once it is up",
                         "servers: " + ", ".join(backend.base_urls))
            return
        settings = Sampling(float(temperature), float(top_p), int(max_tokens))
        text = ""
        try:
            async for delta in backend.stream(chosen, to_messages(history, message,
                                                                  system_prompt), settings):
                text += delta
                yield text
        except PageError as exc:
            yield failed(text, str(exc), f"asked {chosen.id} at {chosen.base_url}")
            return
        if not text:
            yield [notice("(no text: the model ended its reply at once)",
                          f"asked {chosen.id} at {chosen.base_url}")]

    with gr.Blocks(title=TITLE, fill_height=True) as page:
        with gr.Sidebar(label="Settings", open=True):
            picker = gr.Dropdown(choices=labels, value=model or (labels[0] if labels else None),
                                 label="Model", interactive=len(labels) > 1,
                                 elem_id="chat-model")
            system_box = gr.Textbox(value=system, label="System prompt", lines=3,
                                    placeholder="e.g. You are a concise assistant.",
                                    elem_id="chat-system")
            temperature = gr.Slider(0, 2, value=sampling.temperature, step=0.05,
                                    label="Temperature (0: greedy)", elem_id="chat-temperature")
            top_p = gr.Slider(0.05, 1, value=sampling.top_p, step=0.05, label="Top p",
                              elem_id="chat-top-p")
            max_tokens = gr.Slider(1, end, value=min(sampling.max_tokens, end), step=1,
                                   label="Max tokens per reply", elem_id="chat-max-tokens")
            gr.Markdown("Servers:\n" + "\n".join(f"- `{u}`" for u in backend.base_urls),
                        elem_id="chat-servers")
        status = gr.Markdown(_status(listing), visible=bool(listing.errors),
                             elem_id="chat-status")
        gr.ChatInterface(
            respond, title=TITLE, additional_inputs=[picker, system_box, temperature, top_p,
                                                     max_tokens],
            chatbot=gr.Chatbot(elem_id="chat-log", label="Conversation", scale=1,
                               buttons=["copy", "copy_all"], height="70vh"),
            concurrency_limit=CONCURRENCY, flagging_mode="never", fill_height=True,
            autofocus=True)
        page.load(refresh, inputs=[picker], outputs=[picker, status, max_tokens])
    return page


def launch(page: Any, host: str, port: int) -> None:
    """Start the page's server in a background thread (the caller waits and closes it).

    quiet: the caller prints the address itself; no server-side rendering (it would start a
    Node.js process); no share link; the footer without the API link."""
    page.queue(default_concurrency_limit=CONCURRENCY)
    page.launch(server_name=host, server_port=port, prevent_thread_lock=True, quiet=True,
                share=False, inbrowser=False, ssr_mode=False, show_error=False, css=CSS,
                footer_links=["gradio", "settings"])
