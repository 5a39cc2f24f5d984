"""The five sections of a run's configuration, one dataclass each, and the fields a section has.

The allowed values of a field are its type (``Literal`` fields: backends, strategies, precision
modes); :mod:`moebench.config.overrides` reads a ``--set`` value into that type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from moebench.config.backends import resolve_backend
from moebench.precision_modes import ConfigMode

ADDED = "added"  # field metadata: see added_field


def added_field(default: Any) -> Any:
    """A config field added after configs were first hashed: at ``default`` it leaves
    :meth:`Config.hash <moebench.config.run_config.Config.hash>` unchanged (only a scalar default:
    the hash compares the value to it)."""
    return field(default=default, metadata={ADDED: True})


@dataclass
class ModelConfig:
    vocab_size: int = 512
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # None: d_model // n_heads
    qk_norm: bool = False
    # per_head: one RMSNorm over each head's head_dim (Qwen3, the reference benchmark); full: one
    # over the whole projected q (n_heads x head_dim) and one over k (n_kv_heads x head_dim) (OLMoE)
    qk_norm_scope: Literal["per_head", "full"] = "per_head"
    rope_theta: float = 10000.0
    seq_len: int = 64
    n_dense_layers: int = 0  # leading layers with a dense SwiGLU FFN instead of MoE
    dense_hidden: int = 256
    norm_eps: float = 1e-5
    attention_bias: bool = added_field(False)  # biases on the q, k, v and output projections (gpt-oss)
    # Sliding-window attention: a token sees itself and the sliding_window - 1 tokens before it (None:
    # every layer attends causally over the whole sequence). With sliding_window_pattern = P, every
    # P-th layer (layers P-1, 2P-1, ...) attends over the whole sequence and the others use the
    # window; P = 1: every layer uses the window (gpt-oss: window 128, P = 2, layer 0 sliding).
    sliding_window: int | None = added_field(None)
    sliding_window_pattern: int = added_field(1)
    # one learned logit per query head that joins every softmax denominator and attends to nothing
    # (gpt-oss), so a head can put weight on no token
    attention_sinks: bool = added_field(False)
    # The LM head and the loss (moebench.model.loss): None, the head's full [T, V] logits and the
    # reference cross-entropy on them; an integer, the head fused with the loss over chunks of this
    # many tokens, which keeps no [T, V] tensor for backward (single pipeline stage only)
    loss_chunk_tokens: int | None = added_field(None)
    # RMSNorm (block, QK and final norms; moebench.model.norm): "torch", torch's nn.RMSNorm, which
    # keeps fp32 normalised rows (and the q/k norms an fp32 upcast) for backward; "recompute", one
    # that keeps its input as it came and an fp32 rstd a row, and recomputes the rest in backward
    norm_impl: Literal["torch", "recompute"] = added_field("torch")

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def layer_window(self, layer_id: int) -> int | None:
        """The attention window of layer ``layer_id`` (None: the whole causal sequence)."""
        period = self.sliding_window_pattern
        if self.sliding_window is None or (period > 1 and (layer_id + 1) % period == 0):
            return None
        return self.sliding_window


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    shared_expert_hidden: int = 0  # 0: no shared expert
    gating: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to one
    lb_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    bias_gamma: float = 0.0  # aux-loss-free balancing step; 0 disables the bias
    router_bias: bool = added_field(False)  # a learned bias on the router logits (gpt-oss)
    # Group-limited routing (DeepSeek-V3): the experts form expert_groups equal groups, a group
    # scores the sum of its two best selection scores, and a token picks its top_k experts from its
    # expert_groups_per_token best groups only (1 group: no limit). Learned routing only.
    expert_groups: int = added_field(1)
    expert_groups_per_token: int = added_field(1)
    # the routed experts' combined output is multiplied by this (DeepSeek-V3's routed_scaling_factor)
    routed_scaling: float = added_field(1.0)
    # gpt-oss's clamped SwiGLU in the routed experts (None: plain silu(gate) * up); see
    # moebench.kernels.swiglu.swiglu_clamped for the formula
    swiglu_limit: float | None = added_field(None)
    capacity_factor: float = 1.25  # row-wise dispatcher capacity, in multiples of a balanced share
    # "factor": the row-wise capacity is capacity_factor (routes over it are dropped); "lossless":
    # the worst case, no route can drop (capacity_factor is then ignored; see
    # Config.effective_capacity_factor)
    capacity: Literal["factor", "lossless"] = added_field("factor")
    # learned: the router's top-k; random: fresh noise each call; uniform: token t of a call takes
    # experts t*K.. (mod E); skewed: a seeded draw keyed by the token's place in the global batch,
    # the same under every layout (moebench.model.route_keys), skewed by the two fields below
    routing: Literal["learned", "random", "uniform", "skewed"] = "learned"
    # skewed routing: expert r of a token's preference order is drawn with weight (r + 1) ** -skew
    # (0: uniform); the step's tokens form routing_sources equal shares in global-batch order (a
    # data-parallel rank's share when it equals parallel.dp), share j preferring the experts rotated
    # by j * num_experts // routing_sources (1: every token prefers the same experts)
    routing_skew: float = added_field(0.0)
    routing_sources: int = added_field(1)
    # auto: the fastest tested path for the device (resolved_backend); the record's moe_backend says which ran
    backend: Literal["auto", "grouped_mm", "loop", "triton", "cpu_fused"] = "auto"

    def features(self) -> frozenset[str]:
        """The model features (:data:`MOE_FEATURES`) this config turns on."""
        on = {"moe.swiglu_limit": self.swiglu_limit is not None, "moe.router_bias": self.router_bias,
              "moe.expert_groups": self.expert_groups > 1, "moe.routed_scaling": self.routed_scaling != 1.0,
              "moe.shared_expert_hidden": self.shared_expert_hidden > 0}
        return frozenset(name for name, used in on.items() if used)

    def resolved_backend(self, device_type: str) -> str:
        """The backend a run on ``device_type`` uses (see :func:`resolve_backend`)."""
        return resolve_backend(self.backend, device_type, self.features())



@dataclass
class TrainConfig:
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 4  # sequences per rank per forward/backward
    steps: int = 30
    warmup_steps: int = 2  # excluded from timing
    # Adaptive warm-up (moebench.metrics.steady): after warmup_steps, keep warming up while the step
    # time is still falling, up to this many warm-up steps in all; 0: the fixed warmup_steps. The
    # timed window keeps its length (steps - warmup_steps), so a longer warm-up adds steps to the run.
    max_warmup_steps: int = 0
    # extra steps after the timed ones that train.trace traces (untraced runs skip them); 0: none
    profile_steps: int = 2
    # Where the time goes, taken inside every timed step (moebench.model.phases: a host timestamp or
    # an unsynchronised CUDA event at each phase boundary): time_breakdown_s, comm_s. false: none
    # (docs/report.md has what the boundaries cost).
    phase_clock: bool = added_field(True)
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip_grad_norm: float = 1.0
    seed: int = 0
    data: Literal["random", "markov"] = "random"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Regional torch.compile of each transformer block (moebench.model.compile); it compiles in the
    # warm-up steps, outside the timed window, and the record's compile_s says how long that took.
    compile: bool = False
    # A torch.profiler Chrome trace per rank of the profiled steps (moebench.metrics.trace), beside the
    # point's logs; the timed steps are never traced. It changes no result, yet is in the hash (when
    # true) as profile_steps is: a traced store holds other files than an untraced one.
    trace: bool = added_field(False)
    # Torch threads a CPU rank computes with; 0: OMP_NUM_THREADS, or the launcher's share of the CPUs.
    # 1 is the steadiest CPU clock (one thread's process CPU time moved ~1% between runs while the host
    # was steady, more threads spin and wait; the host's own drift moves it more: docs/report.md, Which
    # clock); a GPU run ignores it.
    cpu_threads: int = added_field(0)
    # Count each timed step's instructions under valgrind's callgrind (moebench.metrics.instructions): the
    # clock load cannot move (tokens_per_ginstruction). One CPU process on one thread; the timed steps run
    # about 60x slower under it, so its wall and CPU times time valgrind.
    instructions: bool = added_field(False)

    @property
    def timed_steps(self) -> int:
        """Steps in the timed window, whatever the warm-up took."""
        return self.steps - self.warmup_steps


# the GEMM kinds each precision.scope quantizes: "grouped" the expert GEMMs, "linear" the plain ones
# (the trainer's probe and the planner ask about each kind of the scope)
SCOPE_KINDS: dict[str, tuple[str, ...]] = {"experts": ("grouped",), "linear": ("grouped", "linear")}


@dataclass
class PrecisionConfig:
    # auto: bf16 on GPU, fp32 on CPU. bf16 keeps fp32 master weights (autocast compute).
    # fp8 / mxfp8: bf16 compute with quantized expert GEMMs (fp8: E4M3 + one scale per row;
    # mxfp8: E4M3 + one E8M0 scale per 32 elements); native or emulated per device, see
    # docs/precision.md and the run record's precision_impl.
    mode: ConfigMode = "auto"  # moebench/precision_modes.py
    # MXFP8 block-scale rounding: "up" = ceil(log2(amax/448)) (no saturation), "floor" = OCP
    # reference floor(log2(amax)) - 8 (saturates the top of the binade).
    mxfp8_rounding: Literal["up", "floor"] = "up"
    # which GEMMs fp8 / mxfp8 quantize: "experts" the routed experts only; "linear" also the
    # attention projections, the dense FFNs and the shared expert (never the router, the
    # embedding or the LM head)
    scope: Literal["experts", "linear"] = "experts"
    # what the quantized GEMMs save for backward: "quantized" the E4M3 operands (+ scales) their
    # backward reads, "compute" the compute-dtype inputs (more memory; MXFP8's weight gradient
    # then reads the unquantized activation)
    saved_activations: Literal["quantized", "compute"] = "quantized"
    # true: a quantized mode that would run emulated on this device fails the run with the probe's
    # reason instead (the record's precision_probe_error), e.g. to catch a torch build without the kernels
    require_native: bool = added_field(False)
    # the parameters' dtype. "fp32": fp32 parameters are the master weights and matmuls run under
    # autocast (what the trainer runs). "bf16": OLMo-core's DDP policy, planned only (moebench plan;
    # the trainer refuses it): bf16 compute weights, each bf16 gradient added into a flat fp32 bucket,
    # fp32 main weights and AdamW moments in the optimizer (sharded with parallel.dist_opt)
    param_dtype: Literal["fp32", "bf16"] = added_field("fp32")

    def resolved_mode(self, on_gpu: bool) -> str:
        """The mode a run uses: ``auto`` is bf16 on a GPU and fp32 on CPU; others as set."""
        if self.mode == "auto":
            return "bf16" if on_gpu else "fp32"
        return self.mode


@dataclass
class ParallelConfig:
    strategy: Literal["fsdp", "ddp"] = "ddp"
    dp: int = 1
    ep: int = 1
    pp: int = 1
    dispatcher: Literal["sync", "rowwise"] = "sync"
    # row-wise capacity rule (moebench.parallel.capacity): "destination" one receive capacity per
    # EP rank shared by all sources, drops only on experts over their fair share; "pair" one
    # capacity per (source, destination), the original rule
    rowwise_capacity: Literal["destination", "pair"] = added_field("destination")
    dist_opt: bool = False
    pp_microbatches: int = 2
    pp_schedule: Literal["1f1b", "interleaved-1f1b", "gpipe"] = "1f1b"
    # model chunks (virtual stages) per pipeline rank: None, 2 under interleaved-1f1b and 1 otherwise;
    # more than 1 needs interleaved-1f1b. Stage s runs on pipeline rank s % pp (moebench.layout)
    pp_virtual_stages: int | None = added_field(None)
    # layers of each of the pp x virtual stages, in stage order (sums to model.n_layers); None:
    # contiguous blocks, the first n_layers % stages taking one more (moebench.layout.stage_layer_ranges)
    pp_layers: tuple[int, ...] | None = added_field(None)
    activation_checkpointing: Literal["none", "per-layer"] = "none"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per rank: ``pp_virtual_stages``, or the schedule's default (1 without pp)."""
        if self.pp == 1:
            return 1
        if self.pp_virtual_stages is not None:
            return self.pp_virtual_stages
        return 2 if self.pp_schedule == "interleaved-1f1b" else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages over all ranks: ``pp x virtual_stages``."""
        return self.pp * self.virtual_stages


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "train": TrainConfig,
    "precision": PrecisionConfig,
    "parallel": ParallelConfig,
}

