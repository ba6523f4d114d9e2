"""ik_llama.cpp's ``libllama`` under the llama.cpp runner's names: the ``ik_llamacpp`` backend's binding.

ik_llama.cpp is a fork of llama.cpp that loads the same GGUF files and has its own CPU matmul kernels
(``iqk_mul_mat``: 1..8 activation columns per pass over the weights for the k-quants and IQ types, on
AVX2 and AVX512/VNNI) and run-time repacking of the weights into interleaved rows (``repack_tensors``).
``ik-llama-cpp-python`` (installed by ``scripts/install-ik-llamacpp.sh``, the one place its version and build
flags are kept) ships the library and a thin ctypes module that declares part of its C API. The runner is
:class:`specdecode.models.llamacpp.LlamaCppRunner`, unchanged: :class:`IkBinding` gives it the calls it makes
under llama.cpp's current names, declaring on the library what the module leaves out. What differs:

* ik_llama.cpp keeps the older API: the KV calls take the context (``llama_kv_cache_seq_rm``/``_cp``, no
  memory object), the model's getters are ``llama_n_layer``/``llama_n_ctx_train``, it frees a model with
  ``llama_free_model``, and its sequence-state calls take flags;
* one KV cache holds every sequence (no stream per sequence): the mask keeps a row to its own sequence's
  cells, as with trees; a sequence's state is its cells alone (no stream framing), so a snapshot is the
  library's bytes as they are;
* repacking (``repack=True``) loads the weights into the library's own buffers (no memory map).

The two libraries load side by side in one process (different sonames, ``RTLD_LOCAL``): a draft on one and
a target on the other is possible, but each backend loads its own copy of any model it runs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

from specdecode.models.llamacpp import BATCH_TOKENS, BackendMissing, Binding

INSTALL_HINT = (
    "install it with `scripts/install-ik-llamacpp.sh` "
    "(builds ik-llama-cpp-python from source once: 10–20 minutes on 2 cores)"
)


def available() -> bool:
    """Whether ik-llama-cpp-python is installed (without loading its library)."""
    return importlib.util.find_spec("ik_llama_cpp") is not None


_LOG_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_C = ctypes.c_void_p  # struct pointers: model, context, vocab
_I32, _U32, _POS, _SEQ = ctypes.c_int32, ctypes.c_uint32, ctypes.c_int32, ctypes.c_int32


class IkBinding(Binding):
    """ik_llama.cpp's C API under llama.cpp's names (see the module docstring); loaded on first use."""

    name = "ik_llama.cpp"
    backend = "ik_llamacpp"
    install_hint = INSTALL_HINT
    stream_per_sequence = False

    def __init__(self) -> None:
        self._calls: dict[str, object] | None = None
        self._log: object = None  # kept alive: the library holds the pointer
        self._ggml: ctypes.CDLL | None = None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        calls = self._load()
        if name not in calls:
            raise AttributeError(f"{self.name}'s binding has no {name}")
        return calls[name]

    def _load(self) -> dict[str, object]:
        if self._calls is not None:
            return self._calls
        spec = importlib.util.find_spec("ik_llama_cpp")
        for where in (spec.submodule_search_locations or []) if spec else []:
            ggml = os.path.join(where, "lib", "libggml.so")
            if os.path.isfile(ggml):  # loaded first: a libllama.so built without an RPATH finds it (by soname)
                self._ggml = ctypes.CDLL(ggml)
        try:
            from ik_llama_cpp import _ctypes_api as api
        except ImportError as exc:
            raise BackendMissing(f"the ik_llamacpp backend needs ik-llama-cpp-python: {INSTALL_HINT}") from exc
        lib = api._lib

        def declare(cname: str, argtypes: list, restype):
            fn = getattr(lib, cname)
            fn.argtypes, fn.restype = argtypes, restype
            return fn

        floats = ctypes.POINTER(ctypes.c_float)
        seq_rm = declare("llama_kv_cache_seq_rm", [_C, _SEQ, _POS, _POS], ctypes.c_bool)
        seq_cp = declare("llama_kv_cache_seq_cp", [_C, _SEQ, _SEQ, _POS, _POS], None)
        get_size = declare("llama_state_seq_get_size", [_C, _SEQ, _U32], ctypes.c_size_t)
        get_data = declare(
            "llama_state_seq_get_data", [_C, ctypes.c_void_p, ctypes.c_size_t, _SEQ, _U32], ctypes.c_size_t
        )
        set_data = declare(
            "llama_state_seq_set_data", [_C, ctypes.c_void_p, ctypes.c_size_t, _SEQ, _U32], ctypes.c_size_t
        )
        log_set = declare("llama_log_set", [_LOG_TYPE, ctypes.c_void_p], None)
        calls: dict[str, object] = {
            "llama_backend_init": api.llama_backend_init,
            "llama_log_set": log_set,
            "llama_model_default_params": api.llama_model_default_params,
            "llama_model_load_from_file": api.llama_model_load_from_file,
            "llama_model_free": api.llama_free_model,
            "llama_model_get_vocab": api.llama_model_get_vocab,
            "llama_vocab_n_tokens": api.llama_vocab_n_tokens,
            "llama_vocab_eos": declare("llama_vocab_eos", [_C], _I32),
            "llama_token_eot": declare("llama_token_eot", [_C], _I32),  # the model's (no vocab form here)
            "llama_model_n_embd": api.llama_model_n_embd,
            "llama_model_n_layer": declare("llama_n_layer", [_C], _I32),
            "llama_model_n_ctx_train": declare("llama_n_ctx_train", [_C], _I32),
            "llama_model_desc": declare("llama_model_desc", [_C, ctypes.c_void_p, ctypes.c_size_t], _I32),
            "llama_model_size": declare("llama_model_size", [_C], ctypes.c_uint64),
            "llama_model_meta_val_str": declare(
                "llama_model_meta_val_str", [_C, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t], _I32
            ),
            "llama_context_default_params": api.llama_context_default_params,
            "llama_init_from_model": api.llama_init_from_model,
            "llama_free": api.llama_free,
            "llama_get_memory": lambda ctx: ctx,  # the KV calls take the context itself
            "llama_memory_seq_rm": lambda ctx, seq, p0, p1: seq_rm(ctx, seq, p0, p1),
            "llama_memory_seq_cp": lambda ctx, src, dst, p0, p1: seq_cp(ctx, src, dst, p0, p1),
            "llama_batch_init": api.llama_batch_init,
            "llama_batch_free": api.llama_batch_free,
            "llama_decode": api.llama_decode,
            "llama_set_embeddings": api.llama_set_embeddings,
            "llama_get_logits": declare("llama_get_logits", [_C], floats),
            "llama_get_embeddings": declare("llama_get_embeddings", [_C], floats),
            "llama_state_seq_get_size": lambda ctx, seq: get_size(ctx, seq, 0),
            "llama_state_seq_get_data": lambda ctx, buf, size, seq: get_data(ctx, buf, size, seq, 0),
            "llama_state_seq_set_data": lambda ctx, buf, size, seq: set_data(ctx, buf, size, seq, 0),
        }
        api.llama_backend_init()
        quiet = os.environ.get("SPECDECODE_LLAMACPP_LOG", "") == ""

        @_LOG_TYPE
        def _log(level, text, _user):
            if not quiet or level == 4:  # GGML_LOG_LEVEL_ERROR
                os.write(2, text)

        self._log = _log
        log_set(_log, None)
        self._calls = calls
        return calls

    def model_params(self, repack: bool, mmap: bool):
        params = self.llama_model_default_params()
        params.n_gpu_layers = 0
        # the weights repacked on load into the interleaved rows its multi-column kernels read (the
        # library then reads the file into its own buffers: no memory map)
        params.repack_tensors = repack
        params.use_mmap = mmap and not repack
        return params

    def context_params(self, n_ctx: int, n_seq_max: int, threads: int, threads_batch: int, unified: bool):
        params = self.llama_context_default_params()  # (one KV cache for all sequences, whatever `unified`)
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = n_seq_max
        params.n_threads, params.n_threads_batch = threads, threads_batch
        params.pooling_type = 0  # LLAMA_POOLING_TYPE_NONE: per-token embeddings when asked for
        params.embeddings = False
        return params

    def end_tokens(self, model) -> set[int]:
        vocab = self.llama_model_get_vocab(model)
        return {int(t) for t in (self.llama_vocab_eos(vocab), self.llama_token_eot(model)) if t >= 0}

    def _meta(self, model, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        if self.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) < 0:
            raise RuntimeError(f"{self.name}: the model has no {key!r} metadata")
        return buf.value.decode()

    def kv_width(self, model, hidden_size: int) -> int:
        arch = self._meta(model, "general.architecture")
        heads = int(self._meta(model, f"{arch}.attention.head_count"))
        try:
            kv_heads = int(self._meta(model, f"{arch}.attention.head_count_kv"))
        except RuntimeError:  # no grouped-query attention
            kv_heads = heads
        return kv_heads * (hidden_size // heads)

    def seq_state(self, ctx, seq: int, streams: int, own: int) -> bytes:
        """The sequence's cells as the library writes them (``[count][cells][K][V]``, no sequence id in it)."""
        size = self.llama_state_seq_get_size(ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        return bytes(buf[: self.llama_state_seq_get_data(ctx, buf, size, seq)])

    def set_seq_state(self, ctx, seq: int, state: bytes, streams: int) -> bool:
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return self.llama_state_seq_set_data(ctx, buf, len(state), seq) != 0


IK = IkBinding()
