"""Frozen configuration dataclasses: the model's shape and the engine's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from cupyspec.model.quantized import check_method
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a llama-family decoder (llama, qwen2)."""

    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on the Q/K/V projections (qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in ("llama", "qwen2"):
            raise ValueError(f"unsupported architecture {self.architecture!r} (supported: llama, qwen2)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, memory budget and prefix caching."""

    block_size: int = 16
    # Bytes for the KV pool. None: a fraction of free GPU memory, or 1 GiB on the CPU.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85  # fraction of free GPU memory after weights
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must lie in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    max_model_len: int | None = None  # None: the model's context length
    max_waiting_requests: int = 1024  # a fuller queue refuses new requests (HTTP 503)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start."""

    model: str = "smollm2-135m-instruct"  # a known name, a .gguf file or an HF directory
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    served_model_name: str | None = None
    seed: int = 0  # seeds the generator of requests that give no seed
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    overlap_logprobs: bool = True  # GPU: logprobs of a speculative step on a second stream, beside verification
    cuda_graphs: bool = True  # GPU: steps of up to 2,048 rows replay captured CUDA graphs
    # form and launch step N+1 while step N runs, its tokens fed on the device (not for a step that
    # drafts, nor while penalties run: they need each token on the host first)
    overlap_scheduling: bool = True
    warm_up: bool | None = None  # run requests through every kernel before serving (None: on a GPU only)
    stream_interval: int = 1  # deliver a request's outputs every this many tokens (first and last at once)
    # CPU: threads of the BLAS library that runs the matrix products (None: the CPUs the process may use)
    cpu_threads: int | None = None
    # ranks the model is split across: GPUs 0..N-1 (on the CPU, threads), cupyspec/parallel/
    tensor_parallel_size: int = 1
    # weight-only quantization of the decoder's matrices, "wint8" or "wint4" (cupyspec/model/quantized.py);
    # None: the backend's dtype. An MTP head follows it unless its speculative config names its own.
    quantization: str | None = None
    # prefill/decode disaggregation (cupyspec/disagg/): "both" serves alone; "prefill" runs prompts for
    # decode servers; "decode" hands each prompt to one of `prefill_urls` and decodes it
    role: str = "both"
    prefill_urls: tuple[str, ...] = ()
    # decode role: the most a prefill server's answer, or the fetch of a prompt's K/V, may take before
    # the next server is tried or the prompt is computed here
    prefill_timeout_seconds: float = 30.0
    # prefill role: how long a prefilled prompt's K/V blocks wait for a decode server to read them
    prefill_hold_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.cpu_threads is not None and (type(self.cpu_threads) is not int or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an integer >= 1 or None, not {self.cpu_threads!r}")
        if self.warm_up not in (None, True, False):
            raise ValueError(f"warm_up must be true, false or None, not {self.warm_up!r}")
        object.__setattr__(self, "quantization", check_method(self.quantization, "quantization"))
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, not {self.tensor_parallel_size!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, not {self.role!r}")
        if (self.role == "decode") != bool(self.prefill_urls):
            raise ValueError("prefill_urls are given to the decode role, and only to it")
        if self.role != "both" and self.tensor_parallel_size > 1:
            raise ValueError("the prefill and decode roles run on one GPU for now (tensor_parallel_size 1)")
        if not self.prefill_timeout_seconds > 0:
            raise ValueError(f"prefill_timeout_seconds must be positive, not {self.prefill_timeout_seconds!r}")
        if not self.prefill_hold_seconds > 0:
            raise ValueError(f"prefill_hold_seconds must be positive, not {self.prefill_hold_seconds!r}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, not {self.stream_interval!r}")
