"""One pass over a step's logits: each row's block maxima, maximum and argmax (`scan`).

The batched sampler (batched.py) reads the whole [rows, vocab] logits once per step, and
only that pass grows with the vocabulary, so how it reads memory sets the host's cost of a
step. The logits do not always come row by row:

- NxD Inference hands back float32 [rows, 1, vocab], contiguous: the LM head's output is
  cast on the device (aws-neuron/neuronx-distributed-inference@cd3abf3:src/
  neuronx_distributed_inference/models/model_base.py:L1027-L1028), gathered whole when the
  host samples (L1030-L1039 mask the padded vocabulary to float32's minimum).
- transformers-neuronx hands back a transposed view: the device returns [vocab_padded,
  n_active, batch] in the model's dtype (layers/transformer.py:L282-L288; hlo.py:L307-L312:
  the LM head's dot keeps its weight's dtype), the host concatenates the ranks' shards
  (parallel.py:L147-L148), casts to cast_logits_dtype, float32 by default (base.py:
  L641-L647, config.py:L222), and returns `logits[:vocab_size, -1, :].transpose(0, 1)`
  (base.py:L715-L721): [batch, vocab] with strides (1, batch). A decode whose seq ids are
  0..n-1 gets the first n rows of that view; any other order a contiguous copy
  (base.py:L631-L637). (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.)

A row-major reduction over the transposed view strides through memory one float per
cache line: numpy's max over it took 25-30 ms for 32 x 128,256 on the 2-core bench host,
against ~1 ms row by row. `ColumnScan` reduces the same memory column-wise instead
(torch's reduction over the outer dimension of [blocks, width, rows] is vectorized across
the rows: 0.8-1.1 ms there on one thread, as fast as a contiguous copy's row-wise pass)
and hands the rest of the sampler the same views, so a token does not depend on the
layout.

bf16 logits: where the model runs in bf16, transformers-neuronx's device logits are bf16
and its host cast to float32 changes no value, so the neuron backend asks for bf16
(cast_logits_dtype, neuron_backend.host_logits_dtype): the SDK then skips its cast of
every compiled row. numpy has no bf16, torch's bf16 reductions over this shape took 14-80
ms on the bench host, and casting the rows read to float32 2.4-2.7 ms (32 of 64 rows at
128,256), so `Bf16ColumnScan` reads the bf16 bits as integers instead: torch's int16
max over the whole [vocab, lines] buffer is vectorized across its lines, and from it
(and the int16 min of a block whose values are all negative) comes each block's float
maximum (see the class); only the few blocks and rows a step then reads are converted to
float32.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

#: rows are scanned as this many blocks of columns: a block's maximum says whether any of
#: its tokens can be a candidate, so a peaked row needs one block, not the row, re-read
BLOCKS = 32
#: below this many columns per block, one block per row
MIN_BLOCK = 64


def scan(logits: torch.Tensor) -> NumpyScan | TorchScan:
    """The pass for these logits: numpy row by row, or column-wise for a transposed view
    (`column_major`; a bf16 one through its bits where it can), on CPU; torch elsewhere
    (CUDA)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16,
                                                        torch.float16, torch.float64):
        x = logits.detach()
        if x.dtype == torch.bfloat16 and column_major(x):
            bits = Bf16ColumnScan.of(x)
            if bits is not None:
                return bits
        if x.dtype != torch.float32:  # exact: every bf16/fp16 value is a float32
            # a transposed view is cast in its own memory order, and only its rows; on one
            # thread (32 of 64 rows at 128,256: 2.4-2.7 ms, 5-8 ms on two, one_thread)
            with one_thread():
                x = x.t().float().t() if column_major(x) else x.float()
        if column_major(x):
            return ColumnScan(x)
        return NumpyScan(x.numpy())
    return TorchScan(logits.detach())


def column_major(x: torch.Tensor) -> bool:
    """Whether [rows, vocab] `x` lies column by column (transformers-neuronx's view), so a
    row-wise pass would stride through it."""
    return x.dim() == 2 and x.shape[0] > 1 and x.stride(1) != 1 and x.stride(0) == 1


class NumpyScan:
    """One pass over CPU float32 logits [b, vocab]: each row's block maxima (BLOCKS per
    row, and the columns past the last full block), from which come each row's maximum,
    its argmax and the blocks that can hold candidates.

    The block maxima are taken when first asked for. A step whose every row is greedy
    asks only for every row's argmax, which numpy's argmax gives in the same one pass
    with nothing re-read: 0.82 ms against 1.08 for the block maxima and the best blocks'
    re-read (32 x 128,256 float32 after a 10 ms sleep, medians of 140, on the 2-core bench
    host); a step with other rows takes the block maxima first, and every row from them."""

    def __init__(self, x: np.ndarray, width: int = 0, block_max: np.ndarray | None = None
                 ) -> None:
        self._data = x  # what `_f32` makes float32 logits of (the logits themselves here)
        b, vocab = x.shape
        if not width:
            width = vocab // BLOCKS if vocab >= BLOCKS * MIN_BLOCK else vocab
        nb = vocab // width
        self.width = width
        edge = nb * self.width
        # [b, nb, width]: a view (splitting an axis never copies, whatever the strides)
        self.blocks = x[:, :edge].reshape(b, nb, self.width)
        self.rest = x[:, edge:]  # [b, vocab - edge], narrower than a block
        self._block_max = block_max
        self._max: np.ndarray | None = None

    @property
    def block_max(self) -> np.ndarray:
        """[b, nb]: each row's block maxima; NaN propagates."""
        if self._block_max is None:
            self._block_max = self.blocks.max(axis=2)
        return self._block_max

    @property
    def max(self) -> np.ndarray:
        """[b]: each row's maximum (NaN where the row has one)."""
        if self._max is None:
            self._max = self.block_max.max(axis=1)
            if self.rest.shape[1]:
                self._max = np.maximum(self._max, self._f32(self.rest).max(axis=1))
        return self._max

    @property
    def x(self) -> np.ndarray:
        """The logits, float32 [b, vocab] (masked_sampling reads them directly)."""
        return self._data

    @staticmethod
    def _f32(a: np.ndarray) -> np.ndarray:
        """float32 values of a piece of `_data` (the piece itself here)."""
        return a

    def row(self, i: int) -> np.ndarray:
        return self._f32(self._data[i])

    def argmax(self, rows: list[int]) -> np.ndarray:
        """The first index of each row's maximum (torch.argmax's and numpy's tie rule): the
        first block that reaches it, then the first column in that block."""
        if self._block_max is None and list(rows) == list(range(len(self._data))):
            return self._data.argmax(axis=1)  # every row (a greedy step): one pass
        rows_ = np.asarray(rows)
        m = self.max[rows_]
        hit = self.block_max[rows_] == m[:, None]  # NaN rows: no hit
        found = hit.any(axis=1)
        block = hit.argmax(axis=1)
        out = self._f32(self.blocks[rows_, block]).argmax(axis=1) + block * self.width
        for j in np.flatnonzero(~found):  # NaN, or the maximum is past the last full block
            out[j] = self.row(int(rows_[j])).argmax()
        return out

    def candidates(self, rows: list[int], tau: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (row position in `rows`, column, value) with value >= tau[row position],
        ordered by row, then column."""
        rows_ = np.asarray(rows)
        hit = self.block_max[rows_] >= tau[:, None]  # [m, nb]
        r, blk = np.nonzero(hit)
        if 2 * len(r) > hit.size:  # candidates everywhere (a flat row): compare whole rows
            sub = self._f32(self._data if len(rows_) == len(self._data) else self._data[rows_])
            r, c = np.divmod(np.flatnonzero(sub >= tau[:, None]), self._data.shape[1])
            return r, c, sub[r, c]
        parts_r, parts_c = [r[:0]], [r[:0]]
        if len(r):
            vals = self._f32(self.blocks[rows_[r], blk])  # [hits, width]: blocks that may hold one
            flat = np.flatnonzero(vals >= tau[r][:, None])
            at, col = np.divmod(flat, self.width)
            parts_r.append(r[at])
            parts_c.append(blk[at] * self.width + col)
        if self.rest.shape[1]:
            flat = np.flatnonzero(self._f32(self.rest[rows_]) >= tau[:, None])
            at, col = np.divmod(flat, self.rest.shape[1])
            parts_r.append(at)
            parts_c.append(col + self.blocks.shape[1] * self.width)
        r = np.concatenate(parts_r)
        c = np.concatenate(parts_c)
        if len(parts_r) == 3 and len(parts_r[2]):  # blocks, then the rest: merge by row
            order = np.lexsort((c, r))
            r, c = r[order], c[order]
        return r, c, self._f32(self._data[rows_[r], c])


class ColumnScan(NumpyScan):
    """NumpyScan over a transposed view (memory [vocab, stride], stride >= rows): the block
    maxima come from one column-wise reduction over [blocks, width, rows]; every later
    read (a hit block, a row) is a strided gather of the same numpy view.

    Blocks are COLUMN_WIDTH tokens, not a 32nd of the vocabulary: one row's block here
    spans `width` cache lines (each holds one float of every row), so re-reading the best
    block of 32 rows costs 32 x 4,008 lines (8 MB, half the logits again) at 128,256 / 32,
    and 32 x 128 (256 KB) at this width. More blocks cost the reduction nothing."""

    COLUMN_WIDTH = 128

    def __init__(self, x: torch.Tensor) -> None:
        b, vocab = x.shape
        width = min(self.COLUMN_WIDTH, vocab)
        nb = vocab // width
        cols = x.t()[:nb * width]  # [edge, b], rows of `stride` floats
        with torch.inference_mode(), one_thread():
            block_max = cols.unflatten(0, (nb, width)).amax(dim=1)  # [nb, b]
        super().__init__(x.numpy(), width, block_max.t().numpy())


class Bf16ColumnScan(NumpyScan):
    """ColumnScan over a bf16 transposed view, reading the bf16 bits as int16.

    A bf16 value is sign and magnitude: among values of one sign, its bits as an integer
    order as the values do, ascending for positives and descending for negatives, and as
    int16 every negative is below every positive. So a block's float maximum is the value
    of its int16 maximum where that is >= 0 (a positive NaN, above +inf, stays NaN), else
    of its int16 minimum (every value negative: the one nearest zero). torch reduces int16
    over the device's whole buffer [vocab, lines] vectorized across the lines, which no
    reduction over a subset of the lines is (the scan of 32 of 64 lines at 128,256: 1.1 ms
    back to back and 1.7-2.6 ms after a 10 ms sleep, against 2.4-2.7 and 3.0-3.3 ms for the
    float32 cast of the 32 rows and its ColumnScan, on one thread of a 2-core VM); a row or
    block the sampler then reads is converted as it is read (bf16 bits << 16: its float32).

    A negative NaN lies between -inf and +0.0 in int16 order, which neither reduction
    shows when the block holds other values: any value whose high byte is 0xFF (a
    negative NaN, -inf or below -2^127) sends the step to the float32 path (`of` returns
    None), where NaN ranks as torch.argmax ranks it.

    The int16 minimum is needed only where a block's values are all negative: those
    blocks' lines are gathered (1,024 of them: ~0.2 ms) rather than reduced with the rest
    (0.37 ms back to back, a third of the scan), unless there are more."""

    #: at most this many all-negative (block, line) pairs are gathered for their minimum
    GATHER_LIMIT = 1024

    @classmethod
    def of(cls, x: torch.Tensor) -> Bf16ColumnScan | None:
        """The scan of bf16 [rows, vocab] `x` (column_major), or None: a buffer that does
        not extend over whole lines, a big-endian host, or a value needing the float path."""
        b, vocab = x.shape
        stride = x.stride(1)
        width = min(ColumnScan.COLUMN_WIDTH, vocab)
        nb = vocab // width
        end = x.storage_offset() + nb * width * stride  # the lines' buffer, whole
        if sys.byteorder != "little" or end > x.untyped_storage().nbytes() // x.element_size():
            return None
        lines = torch.as_strided(x, (nb, width, stride), (width * stride, stride, 1))
        bits = lines.view(torch.int16)
        with torch.inference_mode(), one_thread():
            high_byte = bits.view(torch.uint8).amax(dim=1)[:, 1:2 * b:2]  # [nb, b]
            if bool((high_byte == 0xFF).any()):
                return None
            best = bits.amax(dim=1)[:, :b]  # [nb, b]: each block's maximum, as bits...
            blk, line = torch.nonzero(best < 0, as_tuple=True)  # ...but where all negative
            if len(blk) > cls.GATHER_LIMIT:
                best = torch.where(best >= 0, best, bits.amin(dim=1)[:, :b])
            elif len(blk):
                best[blk, line] = bits[blk, :, line].amin(dim=1)
        scan = cls(x, width, cls._f32(best.t().numpy()))
        if scan.rest.shape[1] and (scan.rest.view(np.uint16) >= 0xFF00).any():
            return None  # the same check past the last full block
        return scan

    def __init__(self, x: torch.Tensor, width: int, block_max: np.ndarray) -> None:
        super().__init__(x.view(torch.int16).numpy(), width, block_max)
        self._source = x
        self._x: np.ndarray | None = None

    @staticmethod
    def _f32(a: np.ndarray) -> np.ndarray:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    @property
    def x(self) -> np.ndarray:
        """The logits as float32 [b, vocab], cast once when asked (a grammar's rows)."""
        if self._x is None:
            with one_thread():
                self._x = self._source.t().float().t().numpy()
        return self._x


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads off for a call: on the 2-core bench host the column-wise
    reduction took 0.8-1.1 ms on one thread and 3-12 ms on two while the other core was
    busy (its threads wait for each other); setting the count costs ~1 us."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class TorchScan:
    """The same on logits torch keeps elsewhere (CUDA): whole-row torch ops, and only the
    maxima and candidates come to the host."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.max = x.amax(dim=1).float().cpu().numpy()

    def row(self, i: int) -> np.ndarray:
        return self.x[i].float().cpu().numpy()

    def argmax(self, rows: list[int]) -> np.ndarray:
        return self.x[rows].argmax(dim=1).cpu().numpy()

    def candidates(self, rows: list[int], tau: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sub = self.x[rows].float()
        r, c = (sub >= torch.from_numpy(tau).to(sub.device)[:, None]).nonzero(as_tuple=True)
        return r.cpu().numpy(), c.cpu().numpy(), sub[r, c].cpu().numpy()
