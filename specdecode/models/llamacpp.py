"""The llama.cpp runner: GGUF models on llama.cpp's kernels, behind :class:`~specdecode.models.base.Runner`.

Everything above the runner (the exact engine, drafters, ``check``, ``bench``, the server) is the
same as with the PyTorch runner; only the forward passes run on llama.cpp, through the low-level
C API of ``llama-cpp-python`` (installed by ``scripts/install-llamacpp.sh``, the one place its
version and build flags are kept). The file's quantized weights are used as they are (Q4_K, Q8_0,
...): no dequantization, no conversion cache.

How the interface maps onto llama.cpp:

* a slot is a llama.cpp sequence id, each with its own KV stream (``kv_unified = false``), so a
  batched forward of many sequences attends each row to its own cache only;
* ``forward`` puts every row's tokens in one ``llama_batch`` (positions as given, logits for every
  token) and returns the **logits** as ``hidden``: llama.cpp computes them inside the forward, so
  this runner's :meth:`logits` is the identity (the protocol allows it: ``hidden`` is whatever
  ``logits()`` takes). The final normed hidden state (feature layer ``FINAL``) comes from llama.cpp's
  embeddings output, switched on only for forwards that ask for it;
* llama.cpp keys its cache by position, not by index, and insists that a sequence's new tokens
  continue right after the last one it holds: ``truncate`` is ``llama_memory_seq_rm`` and the runner
  also drops a slot's stale tail before any forward that writes over it (a drafter's padding, say);
* ``copy_slot`` copies a whole stream (``llama_memory_seq_cp``) then cuts it to the length;
  ``export_kv``/``import_kv`` use llama.cpp's per-sequence state;
* trees (``trees=True``, asked for by the engine builder when a drafter grows trees): one KV stream
  shared by all sequences (``kv_unified``) and a sequence id per root-to-leaf path, so llama.cpp's own mask
  (by sequence id and position) is the tree's; ``compact`` of an accepted branch moves nothing, it
  hands the branch's cells to the slot (:mod:`specdecode.models.llamacpp_tree`). Chains-only runners
  keep a stream per slot: a row attends to its own cache only, which costs less at large batches.

Batch-invariant mode (``invariant=True``; ``--batch-invariant on``): a row's logits depend on how many tokens
share its ``llama_decode`` in three places of llama.cpp's CPU backend, measured on Qwen2.5-Coder-1.5B Q4_K_M
(docs/bench/coupled): the weight repack (interleaved blocks: a gemm for each 4 rows of a batch, a gemv for
the rest), a second matmul path from 8 tokens on, and flash attention's split-KV path for a one-token
decode over 512+ cached positions with several threads. The mode loads the model without repack
(``LlamaCppModel(repack=False)``), decodes one-token batches on one thread (llama.cpp's ``n_threads``; wider
batches keep ``n_threads_batch``), and cuts every forward — prefill chunks included — into decodes no wider
than the widest whose rows equal one-token decodes bit for bit, probed once per model on this machine
(:meth:`LlamaCppRunner.invariant_width`). Chains only (a tree's nodes are decoded together).

Not served (a clear :class:`BackendUnsupported` error, before anything runs): hidden states of
intermediate layers, and feeding input embeddings — so EAGLE drafters need ``--backend torch``.
The draft model, n-gram and Medusa drafters work, as chains and as trees.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import UserError
from specdecode.models.base import FINAL, Features, ForwardOutput, Runner
from specdecode.models.llamacpp_tree import MAX_SEQ, NodeTable

INSTALL_HINT = (
    "install it with `scripts/install-llamacpp.sh` (builds llama-cpp-python from source once: 10–20 minutes on 2 cores)"
)
BATCH_TOKENS = 512  # tokens per llama_decode call (llama.cpp's n_batch = n_ubatch)
OUTPUT_TOKENS = 256  # at most this many tokens per call when logits come back (its buffer: rows x vocab floats)
KV_PAD = 256  # llama.cpp rounds each sequence's cache to a multiple of this
PROBE_PREFIX, PROBE_WIDTH = 8, 8  # invariant mode: a probe's prompt, and the widest decode it tries


class BackendMissing(UserError, ImportError):
    """The llama.cpp backend was asked for but llama-cpp-python is not installed."""


class BackendUnsupported(UserError, ValueError):
    """Something the llama.cpp runner does not do (intermediate layers, input embeddings, trees on a
    chains-only runner)."""


_LIB = None
_LOG_CALLBACK = None  # kept alive: llama.cpp holds the pointer


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def lib():
    """The low-level llama.cpp bindings, initialised once (errors only on stderr)."""
    global _LIB, _LOG_CALLBACK
    if _LIB is None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise BackendMissing(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from exc
        llama_cpp.llama_backend_init()
        quiet = os.environ.get("SPECDECODE_LLAMACPP_LOG", "") == ""

        @llama_cpp.llama_log_callback
        def _log(level, text, _user):
            if not quiet or level == 4:  # GGML_LOG_LEVEL_ERROR
                os.write(2, text)

        _LOG_CALLBACK = _log
        llama_cpp.llama_log_set(_LOG_CALLBACK, None)
        _LIB = llama_cpp
    return _LIB


class Binding:
    """A libllama as the runner drives it: the C API under llama.cpp's current names (``llama_decode``,
    ``llama_memory_seq_rm``, ...) plus the few calls whose parameters differ between llama.cpp and its
    forks. This one is llama-cpp-python's (every name is the module's); :mod:`specdecode.models.ik_llamacpp`
    maps ik_llama.cpp's onto the same names, so one runner drives both."""

    name = "llama.cpp"  # what messages call it
    backend = "llamacpp"  # the backend's registry name
    install_hint = INSTALL_HINT
    stream_per_sequence = True  # can give each sequence its own KV stream (kv_unified off)

    def __getattr__(self, name: str):
        return getattr(lib(), name)

    def model_params(self, repack: bool, mmap: bool):
        params = self.llama_model_default_params()
        params.n_gpu_layers = 0
        # llama.cpp's CPU repack (weights in interleaved blocks, a gemm for each 4 rows of a batch and a gemv
        # for the rest) makes a row's logits depend on the batch width; without it every row takes one path
        params.use_extra_bufts = repack
        # NONE: read into its own buffers; AUTO (its default): on a CPU, a memory map
        params.load_mode = self.LLAMA_LOAD_MODE_AUTO if mmap else self.LLAMA_LOAD_MODE_NONE
        return params

    def context_params(self, n_ctx: int, n_seq_max: int, threads: int, threads_batch: int, unified: bool):
        params = self.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = n_seq_max
        params.n_threads, params.n_threads_batch = threads, threads_batch
        params.kv_unified = unified
        params.pooling_type = 0  # LLAMA_POOLING_TYPE_NONE: per-token embeddings when asked for
        params.embeddings = False
        params.no_perf = True
        return params

    def end_tokens(self, model) -> set[int]:
        vocab = self.llama_model_get_vocab(model)
        return {int(t) for t in (self.llama_vocab_eos(vocab), self.llama_vocab_eot(vocab)) if t >= 0}

    def kv_width(self, model, hidden_size: int) -> int:
        """K (or V) values per token and layer."""
        return self.llama_model_n_head_kv(model) * (hidden_size // self.llama_model_n_head(model))

    def seq_state(self, ctx, seq: int, streams: int, own: int):
        """Sequence ``seq``'s state, in a form :meth:`set_seq_state` takes into any context over the weights.

        llama.cpp frames a sequence's state as ``[magic][seq id][n_stream]`` then ``[count, cells]`` per
        stream, only the sequence's own stream non-empty, and refuses it in a context with another stream
        count. The snapshot keeps the magic and that one stream's record, so any context over these weights
        (another batch size: another stream count) can import it."""
        size = self.llama_state_seq_get_size(ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        data = bytes(buf[: self.llama_state_seq_get_data(ctx, buf, size, seq)])
        head, tail = 12 + 4 * own, len(data) - 4 * (int.from_bytes(data[8:12], "little") - own - 1)
        if int.from_bytes(data[8:12], "little") != streams or any(data[12:head]) or any(data[tail:]):
            raise RuntimeError("unexpected llama.cpp sequence-state layout (another llama-cpp-python version?)")
        return data[:4], data[head:tail]

    def set_seq_state(self, ctx, seq: int, state, streams: int) -> bool:
        magic, record = state
        data = magic + seq.to_bytes(4, "little") + streams.to_bytes(4, "little") + record + bytes(4 * (streams - 1))
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)  # llama.cpp reads the record into seq's stream
        return self.llama_state_seq_set_data(ctx, buf, len(data), seq) != 0


MAINLINE = Binding()


def default_threads() -> int:
    """A library caller's default (the command line passes its own: :func:`specdecode.machine.default_threads`)."""
    from specdecode.machine import usable_cores

    return usable_cores()


REQUANT_TYPES = {"q8_0": 7, "q4_0": 2}  # --draft-quantization -> llama_ftype (LLAMA_FTYPE_MOSTLY_*)


def requantize(path: str | Path, mode: str, threads: int | None = None) -> Path:
    """``path`` (a .gguf file) requantized to ``mode`` (q8_0 or q4_0) by llama.cpp's own quantizer,
    cached beside the converted models (keyed by the file's path, size and mtime); the cached file
    when it exists. Each tensor llama.cpp can quantize to that type is; the others keep theirs."""
    from specdecode.models.loading import cache_dir_for

    if mode not in REQUANT_TYPES:
        raise ValueError(f"cannot requantize to {mode!r}: choose one of {', '.join(REQUANT_TYPES)}")
    out = cache_dir_for(Path(path), f"{mode}.gguf")
    if out.is_file():
        return out
    ll = lib()
    params = ll.llama_model_quantize_default_params()
    params.ftype = REQUANT_TYPES[mode]
    params.nthread = threads or default_threads()
    params.allow_requantize = True  # the file's tensors are often quantized already (Q8_0, Q4_K, ...)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}.{os.getpid()}")
    try:
        if ll.llama_model_quantize(str(path).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not requantize {path} to {mode}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp (every runner over it shares its weights). ``mmap=False`` (``--weights
    resident``, the default of the commands) has llama.cpp read the file into its own buffers instead of
    mapping it (``load_mode`` NONE), so the kernel cannot drop the pages and read them back mid-request (see
    :func:`specdecode.models.loading.make_resident`); repacked weights are llama.cpp's own copies either way."""

    def __init__(
        self,
        path: str | Path,
        threads: int | None = None,
        repack: bool = True,
        mmap: bool = True,
        binding: Binding = MAINLINE,
    ) -> None:
        ll = self.binding = binding
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        self.threads = threads or default_threads()
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        params = ll.model_params(repack, mmap)
        self.repack, self.mmap = repack, mmap
        self.invariant_widths: dict[int, int] = {}  # threads -> widest invariant decode (probed by a runner)
        self.ptr = ll.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise ValueError(f"{ll.name} could not load {self.path} (not a GGUF model it supports?)")
        vocab = ll.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(ll.llama_vocab_n_tokens(vocab))
        self.hidden_size = int(ll.llama_model_n_embd(self.ptr))
        self.num_layers = int(ll.llama_model_n_layer(self.ptr))
        self.context_length = int(ll.llama_model_n_ctx_train(self.ptr))
        self.eos_token_ids = ll.end_tokens(self.ptr)
        stat = self.path.stat()
        self.identity = f"{ll.backend}:{self.path}:{stat.st_size}:{stat.st_mtime_ns}"
        # what commands read off a model: its context length (like a transformers config)
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.ptr, buf, len(buf))
        self.description = buf.value.decode(errors="replace")
        self.size_bytes = int(ll.llama_model_size(self.ptr))

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr and getattr(self, "binding", None) is not None:
            self.binding.llama_model_free(ptr)


def output_layer(path: Path, hidden: torch.Tensor, rows: int = 16384) -> torch.Tensor:
    """``hidden [..., H] @ W.T`` for the output layer ``W [V, H]`` of the GGUF file at ``path`` (the token
    embeddings when the file ties them), dequantized ``rows`` vocabulary rows at a time."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    weight = tensors.get("output.weight") or tensors["token_embd.weight"]
    flat = hidden.reshape(-1, hidden.shape[-1])
    parts = [
        flat @ torch.from_numpy(dequantize(weight.data[a : a + rows], weight.tensor_type).astype(np.float32)).T
        for a in range(0, weight.data.shape[0], rows)
    ]
    return torch.cat(parts, dim=-1).reshape(*hidden.shape[:-1], -1)


class LlamaCppRunner(Runner):
    """Slot-addressed sequences on a llama.cpp context (see the module docstring)."""

    backend = "llamacpp"
    # how far one token's logits move with the kernels llama.cpp picks for the batch's shape (a k-token
    # verify vs a one-token step): up to ~1.7 % of the top logit measured on Qwen2.5-Coder-1.5B Q4_K_M
    # (activations are quantized per row, then other matmul and attention paths run). `check` calls a
    # greedy divergence within near_tie_rel * |top logit| a numeric near-tie; `bench` likewise (logit_eps)
    near_tie_rel = 2.0**-5
    logit_eps = 2.0**-6
    # A slot restored from a snapshot computed other logits than a prefill of the same tokens in `check`
    # (part 5 after part 3, tiny GGUF pairs: diff 6.2 in the draft's logits at the first step, in one
    # batch layout and only once; a standalone replay of the same imports is exact): not promised
    kv_snapshots_exact = False

    def __init__(
        self, model: LlamaCppModel, num_slots: int = 0, max_len: int = 0, trees: bool = False, invariant: bool = False
    ) -> None:
        if invariant and trees:
            raise BackendUnsupported("batch-invariant llama.cpp verifies chains only (a tree's nodes share one decode)")
        if invariant and model.repack:
            raise BackendUnsupported(
                f"batch-invariant llama.cpp needs the model loaded without CPU repack "
                f"(LlamaCppModel(repack=False); --batch-invariant on does it): {model.path}"
            )
        self.ll = model.binding
        self.backend = model.binding.backend
        self.model = model
        self.trees = trees
        self.batch_invariant = invariant
        self.decode_width = BATCH_TOKENS  # tokens per llama_decode at most (invariant mode: the probed width)  # one KV stream for all slots and sequence ids per tree path (see the module docstring)
        self._tree: NodeTable | None = None
        self.vocab_size = model.vocab_size
        self.hidden_size = model.hidden_size
        self.num_layers = model.num_layers
        self.dtype = torch.float32  # what logits and features come back as
        self.device = torch.device("cpu")
        self.identity = model.identity
        self.eos_token_ids = set(model.eos_token_ids)
        self.threads: int = model.threads  # (always set here: the model's count)
        self.num_slots = self.max_len = 0
        self.ctx = None
        self._batch: Any = None  # a llama_batch (ctypes, untyped) from ensure_capacity until freed
        self._embeddings = False
        self._length: list[int] = []  # per slot: 1 + the highest position the cache holds (0: empty)
        if num_slots and max_len:
            self.ensure_capacity(num_slots, max_len)

    @property
    def where(self) -> str:
        mode = f", batch-invariant (decodes of <= {self.decode_width} tokens)" if self.batch_invariant else ""
        return f"{self.ll.name} {self.model.description}, {self.threads} threads{mode}"

    # -- sizes ------------------------------------------------------------------------------------
    def ensure_capacity(self, num_slots: int, max_len: int) -> None:
        if self.ctx is not None and self.num_slots >= num_slots and self.max_len >= max_len:
            return
        num_slots, max_len = max(num_slots, self.num_slots), max(max_len, self.max_len)
        if num_slots > 256:
            raise BackendUnsupported(f"llama.cpp serves at most 256 sequences per context, asked for {num_slots}")
        self._free()
        per_slot = -(-max_len // KV_PAD) * KV_PAD
        tree = NodeTable(num_slots) if self.trees else None  # (refuses too many slots before anything is made)
        # chains: a stream per sequence where the library has them, a row attends to its own cache only;
        # trees: one stream, ids per path. One-token decodes of the invariant mode run on one thread (no
        # split-KV flash attention, see above)
        params = self.ll.context_params(
            per_slot * num_slots,
            MAX_SEQ if self.trees else num_slots,
            1 if self.batch_invariant else self.model.threads,
            self.model.threads,
            unified=self.trees,
        )
        ctx = self.ll.llama_init_from_model(self.model.ptr, params)
        if not ctx:
            raise RuntimeError(f"{self.ll.name} could not create a context of {num_slots} x {per_slot} positions")
        self.ctx, self.mem = ctx, self.ll.llama_get_memory(ctx)
        self._embeddings = False
        self._batch = self.ll.llama_batch_init(BATCH_TOKENS, 0, MAX_SEQ if self.trees else 1)
        self.num_slots, self.max_len = num_slots, max_len
        self._length = [0] * num_slots
        self._tree = tree
        if self.batch_invariant:
            self.decode_width = self.invariant_width()

    def invariant_width(self) -> int:
        """The widest ``llama_decode`` (at most PROBE_WIDTH tokens) whose every row's logits equal the same
        row decoded one token at a time, bit for bit, on this model, machine and thread count: widths 2..
        PROBE_WIDTH decode the tail of a seeded random sequence in chunks of that width after a shared
        prefix. Probed once per model and thread count (slot 0 of a fresh context; it is emptied after)."""
        known = self.model.invariant_widths.get(self.threads)
        if known is not None:
            return known
        gen = np.random.default_rng(0)
        toks = [int(t) for t in gen.integers(0, self.vocab_size, PROBE_PREFIX + PROBE_WIDTH)]

        def rows(width: int) -> torch.Tensor:
            self._forget_from(0, PROBE_PREFIX)
            out: list[torch.Tensor] = []
            for lo in range(PROBE_PREFIX, len(toks), width):
                self._decode(
                    [(0, toks[lo : lo + width], lo)], True, False, lambda _, x, __: out.append(torch.tensor(x))
                )
            return torch.cat(out)

        self._forget_from(0, 0)
        self._decode([(0, toks[:PROBE_PREFIX], 0)], False, False)
        ref, width = rows(1), 1
        for w in range(2, PROBE_WIDTH + 1):
            if not torch.equal(rows(w), ref):
                break
            width = w
        self._forget_from(0, 0)
        self.model.invariant_widths[self.threads] = width
        return width

    def _free(self) -> None:
        if self._batch is not None:
            self.ll.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx is not None:
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        if getattr(self, "ll", None) is not None:
            self._free()

    def kv_bytes(self) -> int:
        if self.ctx is None:
            return 0
        # K and V of every layer in float16 (llama.cpp's default cache type), for every slot's stream
        kv_width = self.ll.kv_width(self.model.ptr, self.hidden_size)
        return 2 * 2 * self.num_layers * kv_width * self.num_slots * (-(-self.max_len // KV_PAD) * KV_PAD)

    # -- forward ----------------------------------------------------------------------------------
    @staticmethod
    def _check(layers: Sequence[int]) -> bool:
        other = [layer for layer in layers if layer != FINAL]
        if other:
            raise BackendUnsupported(
                f"the llama.cpp backend gives the final hidden state only, not layers {other} "
                "(EAGLE drafters need --backend torch)"
            )
        return FINAL in layers

    def _set_embeddings(self, on: bool) -> None:
        if on != self._embeddings:
            self.ll.llama_set_embeddings(self.ctx, on)
            self._embeddings = on

    def _forget_from(self, slot: int, position: int) -> None:
        """Drop what ``slot`` holds at ``position`` and past (a no-op when it holds nothing there)."""
        if self._length[slot] > position:
            self.ll.llama_memory_seq_rm(self.mem, slot, position, -1)
            self._length[slot] = position

    def _submit(self, tokens: list[tuple[int, int, Sequence[int]]], outputs: bool, features: bool):
        """One llama_decode of ``tokens`` = (token, position, sequence ids); the logits [n, V] and final
        states [n, H] (numpy views, valid until the next decode) when ``outputs``."""
        b = self._batch
        for n, (tok, pos, seqs) in enumerate(tokens):
            b.token[n] = tok
            b.pos[n] = pos
            b.n_seq_id[n] = len(seqs)
            for j, seq in enumerate(seqs):
                b.seq_id[n][j] = seq
            b.logits[n] = outputs
        n = b.n_tokens = len(tokens)
        self._set_embeddings(features)
        code = self.ll.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(
                f"llama_decode failed with status {code} ({n} tokens, sequences "
                f"{sorted({s for t in tokens for s in t[2]})[:16]})"
            )
        if not outputs:
            return None, None
        logits = np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(n, self.vocab_size))
        embd = (
            np.ctypeslib.as_array(self.ll.llama_get_embeddings(self.ctx), shape=(n, self.hidden_size))
            if features
            else None
        )
        return logits, embd

    def _decode(self, rows: list[tuple[int, list[int], int]], outputs: bool, features: bool, sink=None) -> None:
        """Run ``rows`` = (slot, tokens, first position), at most BATCH_TOKENS tokens in all, as one
        llama_decode; when ``outputs``, ``sink(k, logits [n, V], states [n, H] or None)`` for each row ``k``:
        numpy views of llama.cpp's buffers, valid until the next decode, so the sink copies what it keeps
        once, straight to where it goes."""
        logits, embd = self._submit(
            [(tok, p0 + j, (slot,)) for slot, toks, p0 in rows for j, tok in enumerate(toks)], outputs, features
        )
        for slot, toks, p0 in rows:
            self._length[slot] = p0 + len(toks)
        if not outputs or sink is None:
            return
        at = 0
        for k, (_, toks, _) in enumerate(rows):
            sink(k, logits[at : at + len(toks)], embd[at : at + len(toks)] if features else None)
            at += len(toks)

    def _run(self, rows: list[tuple[int, list[int], int]], outputs: bool, features: bool, sink=None) -> None:
        """Decode ``rows`` in llama_decode calls of at most BATCH_TOKENS tokens (OUTPUT_TOKENS when logits
        come back; a long row in pieces, in order); ``sink(i, lo, logits, states)`` gets row ``i``'s outputs
        from its token ``lo`` on (see :meth:`_decode`)."""
        for slot, _, p0 in rows:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
            self._release_tree(slot)  # a chain forward after a tree: the tree's nodes are stale
            self._forget_from(slot, p0)
            if self._length[slot] != p0:
                raise ValueError(f"slot {slot} holds {self._length[slot]} positions; a forward cannot start at {p0}")
        limit = min(OUTPUT_TOKENS if outputs else BATCH_TOKENS, self.decode_width)
        pieces = [
            (i, lo, slot, toks[lo : lo + limit], p0 + lo)
            for i, (slot, toks, p0) in enumerate(rows)
            for lo in range(0, len(toks), limit)
        ]
        group: list = []
        size = 0

        def flush() -> None:
            def put(k: int, logits, states) -> None:
                i, lo = group[k][:2]
                sink(i, lo, logits, states)

            self._decode([(slot, toks, p0) for _, _, slot, toks, p0 in group], outputs, features, put)

        for piece in pieces:
            # a row's pieces go in order: a new group starts before a second piece of a row in this one
            if group and (size + len(piece[3]) > limit or any(g[0] == piece[0] for g in group)):
                flush()
                group, size = [], 0
            group.append(piece)
            size += len(piece[3])
        if group:
            flush()

    @torch.inference_mode()
    def forward(
        self,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        write_positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        tree_start: torch.Tensor | None = None,
        layers: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """``hidden`` holds the logits ``[B, q, V]`` (see the module docstring). A row's tokens must
        sit at consecutive positions; a row's tail whose positions stop increasing (a drafter's
        padding clamped at the end of the cache) is not run and gets zero logits."""
        if inputs_embeds is not None:
            raise BackendUnsupported(
                "the llama.cpp backend cannot feed input embeddings (EAGLE drafters need --backend torch)"
            )
        assert self.ctx is not None, "no context: call ensure_capacity() first"
        features = self._check(layers)
        if tree_mask is not None or (
            write_positions is not None and not torch.equal(write_positions.cpu(), positions.cpu())
        ):
            if not self.trees:
                raise BackendUnsupported(
                    "this llama.cpp runner was made for chains (a KV stream per slot); a tree "
                    "forward needs LlamaCppRunner(trees=True), which the engine builds for "
                    "--tree-topk > 1"
                )
            if tree_mask is None:
                raise BackendUnsupported(
                    "the llama.cpp backend writes K/V away from their positions only for tree nodes (with a tree mask)"
                )
            return self._forward_tree(slots, input_ids, positions, write_positions, tree_mask, tree_start, features)
        ids, pos = input_ids.tolist(), positions.tolist()
        rows = []
        for slot, toks, ps in zip(slots.tolist(), ids, pos):
            n = 1
            while n < len(ps) and ps[n] == ps[n - 1] + 1:
                n += 1
            rows.append((slot, toks[:n], ps[0]))
        bsz, q = input_ids.shape
        # each row's logits are copied once, from llama.cpp's buffer to their place in ``out``; only the
        # tails that are not run are zeroed (a full-vocabulary tensor per step: no zero fill, no concatenation)
        out = torch.empty(bsz, q, self.vocab_size)
        final = torch.empty(bsz, q, self.hidden_size) if features else None

        def put(b: int, lo: int, logits, states) -> None:
            np.copyto(out[b, lo : lo + len(logits)].numpy(), logits)
            if final is not None:
                np.copyto(final[b, lo : lo + len(states)].numpy(), states)

        self._run(rows, True, features, put)
        for b, (_, toks, _) in enumerate(rows):
            if len(toks) < q:
                out[b, len(toks) :] = 0
                if final is not None:
                    final[b, len(toks) :] = 0
        return ForwardOutput(out, {FINAL: final} if final is not None else {})

    def _forward_tree(
        self, slots, input_ids, positions, write_positions, tree_mask, tree_start, features: bool
    ) -> ForwardOutput:
        """A tree forward (see :mod:`specdecode.models.llamacpp_tree`): every row's new nodes in one
        llama_decode where they fit (rows split across calls, never a row). A row's window starts at
        ``tree_start`` (default: its smallest write index); the slot's cells from the first window
        key a node does not see, or from the first write index, are dropped first (a drafter's
        padding, a slot's stale tail: as a chain forward drops one), the ones before are the prefix
        every node sees."""
        writes = (positions if write_positions is None else write_positions).tolist()
        ids, pos, mask = input_ids.tolist(), positions.tolist(), tree_mask.cpu()
        bsz, q = input_ids.shape
        plans = []  # (slot, where its cells end, plan)
        assert self._tree is not None  # (forward refuses a tree forward on a runner made without trees)
        try:
            for b, slot in enumerate(slots.tolist()):
                if not 0 <= slot < self.num_slots:
                    raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
                t0 = int(tree_start[b]) if tree_start is not None else min(writes[b])
                committed = self._length[slot]
                seen_by_all = mask[b, :, : max(0, min(committed - t0, mask.shape[-1]))].all(0).tolist()
                if t0 < committed:
                    committed = t0 + (seen_by_all.index(False) if False in seen_by_all else len(seen_by_all))
                committed = min(committed, *writes[b])  # cells the nodes are written over are a stale tail too
                visible = [
                    {t0 + j for j in mask[b, i].nonzero().flatten().tolist() if t0 + j >= committed} for i in range(q)
                ]
                plans.append((slot, committed, self._tree.plan(slot, committed, writes[b], ids[b], pos[b], visible)))
        except BaseException:
            self._drop_planned(plans)
            raise
        for slot, committed, plan in plans:
            self._forget_from(slot, committed)
            for seq, p0 in plan.drop:
                self.ll.llama_memory_seq_rm(self.mem, seq, p0, -1)
            for src, dst, p1 in plan.copies:
                self.ll.llama_memory_seq_cp(self.mem, src, dst, -1, p1)
        out = torch.empty(bsz, q, self.vocab_size)  # (every query of every row is written below)
        final = torch.empty(bsz, q, self.hidden_size) if features else None
        group: list[int] = []

        def flush() -> None:
            logits, embd = self._submit([t for b in group for t in plans[b][2].tokens], True, features)
            at = 0
            for b in group:
                plan = plans[b][2]
                rows = [at + t for t in plan.query_token]  # one copy, from llama.cpp's buffer to the row's place
                np.take(logits, rows, axis=0, out=out[b].numpy())
                if final is not None:
                    np.take(embd, rows, axis=0, out=final[b].numpy())
                at += len(plan.tokens)

        try:
            for b, (_, _, plan) in enumerate(plans):
                if len(plan.tokens) > OUTPUT_TOKENS:
                    raise BackendUnsupported(
                        f"a tree of {len(plan.tokens)} nodes exceeds llama.cpp's {OUTPUT_TOKENS} outputs per call"
                    )
                if group and sum(len(plans[g][2].tokens) for g in group) + len(plan.tokens) > OUTPUT_TOKENS:
                    flush()
                    group = []
                group.append(b)
            if group:
                flush()
        except BaseException:
            for slot, _, _ in plans:  # the rows' trees are unusable: forget them, keep the committed cells
                self._release_tree(slot)
            raise
        return ForwardOutput(out, {FINAL: final} if final is not None else {})

    def _drop_planned(self, plans) -> None:
        """Undo planned rows that never ran: remove what their plans freed, then their trees."""
        for slot, _, plan in plans:
            for seq, p0 in plan.drop:
                self.ll.llama_memory_seq_rm(self.mem, seq, p0, -1)
            self._release_tree(slot)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The identity: :meth:`forward` already returns logits as ``hidden``."""
        if hidden.shape[-1] != self.vocab_size:
            raise BackendUnsupported(
                "the llama.cpp runner cannot apply its output layer to hidden states; "
                "logits() takes what its forward returned (score_hidden() scores states)"
            )
        return hidden.float()

    def score_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final normed states ``[..., H]`` through the file's output layer, dequantized a block of rows at
        a time: slow, for one-off checks (a heads checkpoint's fingerprint probe)."""
        if hidden.shape[-1] != self.hidden_size:
            raise BackendUnsupported(f"score_hidden takes states of width {self.hidden_size}, not {hidden.shape[-1]}")
        return output_layer(self.model.path, hidden.float())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise BackendUnsupported(
            "the llama.cpp backend does not expose input embeddings (EAGLE drafters need --backend torch)"
        )

    @torch.inference_mode()
    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[list[int]],
        layers: Sequence[int] = (),
        starts: Sequence[int] | None = None,
    ) -> list[Features]:
        features = self._check(layers)
        starts = [0] * len(prompts) if starts is None else list(starts)
        for slot, start in zip(slots, starts):  # the slot keeps what precedes the prompt (chunks), no more
            self._release_tree(slot)
            self._forget_from(slot, start)
            if self._length[slot] != start:
                raise ValueError(f"slot {slot} holds {self._length[slot]} positions; a prefill cannot start at {start}")
        rows = [(slot, list(p), start) for slot, p, start in zip(slots, prompts, starts) if p]
        pieces: list[list[torch.Tensor]] = [[] for _ in rows]

        def keep(i: int, lo: int, logits, states) -> None:
            pieces[i].append(torch.from_numpy(states.copy()))

        if rows:
            self._run(rows, features, features, keep)
        feats = [torch.cat(x) if x else torch.zeros(0, self.hidden_size) for x in pieces]
        out: list[Features] = []
        it = iter(feats)
        for p in prompts:
            if not features:
                out.append({})
            else:
                out.append({FINAL: next(it) if p else torch.zeros(0, self.hidden_size)})
        return out

    # -- KV operations ----------------------------------------------------------------------------
    def _release_tree(self, slot: int) -> None:
        """Remove the slot's tree nodes from the cache (their cells go unless the slot took them)."""
        if self._tree is not None and self._tree.held(slot):
            for seq in self._tree.release(slot):
                self.ll.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def _adopt(self, slot: int, branch: tuple[int, int, int] | None) -> None:
        """The slot takes a branch of its tree (its cells, already at their positions), then drops the tree."""
        if branch is not None:
            seq, lo, hi = branch
            self.ll.llama_memory_seq_cp(self.mem, seq, slot, lo, hi)
            self._length[slot] = hi
        self._release_tree(slot)

    def truncate(self, slot: int, length: int) -> None:
        if self._tree is not None and self._tree.held(slot):  # keeps a branch taken in node order (no compact)
            self._adopt(slot, self._tree.prefix_branch(slot, self._length[slot], length))
        self._forget_from(slot, length)

    def compact(self, slot: int, src: Sequence[int], dst_start: int) -> None:
        if self._tree is not None and self._tree.held(slot):
            branch = self._tree.branch(slot, self._length[slot], list(src))
            if branch is not None and branch[2] != dst_start + len(src):
                raise BackendUnsupported(
                    f"tree nodes {list(src)} of slot {slot} cannot move to {dst_start}: on "
                    "llama.cpp a branch stays at its positions"
                )
            self._adopt(slot, branch)
            return
        if list(src) != list(range(dst_start, dst_start + len(src))):
            raise BackendUnsupported(
                "this llama.cpp runner holds no tree nodes to compact (trees need LlamaCppRunner(trees=True))"
            )

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        if src == dst:
            return
        self._release_tree(dst)
        self.ll.llama_memory_seq_rm(self.mem, dst, -1, -1)
        self.ll.llama_memory_seq_cp(
            self.mem, src, dst, -1, -1
        )  # a stream per slot: the whole stream; unified: shared cells
        self._length[dst] = self._length[src]
        self._forget_from(dst, length)

    def export_kv(self, slot: int, length: int):
        """The slot's sequence state (the slot is untouched), in a form any context over these weights takes
        (:meth:`Binding.seq_state`); import keeps ``length``."""
        state = self.ll.seq_state(self.ctx, slot, self._streams(), self._stream(slot))
        return (self.identity, length, self._length[slot], state)

    def import_kv(self, slot: int, state) -> None:
        identity, length, held, data = state
        if identity != self.identity:
            raise ValueError("a KV snapshot of other weights cannot be imported")
        self._release_tree(slot)
        self.ll.llama_memory_seq_rm(self.mem, slot, -1, -1)
        if not self.ll.set_seq_state(self.ctx, slot, data, self._streams()):
            raise RuntimeError(f"{self.ll.name} refused a KV snapshot for slot {slot}")
        self._length[slot] = held
        self._forget_from(slot, length)

    def _streams(self) -> int:
        return 1 if self.trees or not self.ll.stream_per_sequence else self.num_slots

    def _stream(self, slot: int) -> int:
        return 0 if self._streams() == 1 else slot
