"""Typed configuration schema for nxd_lc (NxDT-compatible key tree).

Every section of a Hydra YAML (``trainer``, ``exp_manager``, ``distributed_strategy``, ``data``, ``model``,
``precision`` and NxDT's top-level runtime keys) is a dataclass here, registered in Hydra's ConfigStore under
``nxd_lc_schema``. Defaults live on the fields; the comment after each field is its one-line doc (the dry run
prints it). Library code receives these typed objects, never a raw ``DictConfig``.

Keys NxDT accepts but whose feature lands in a later issue are present so NxDT files load; validation rejects a
non-default value with ``not supported yet: <key>`` before anything is built (see ``validate.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from nxd_lc.config.alignment_schema import ALIGNMENT_KEY_ALIASES, ModelAlignmentStrategyConfig


@dataclass
class TrainerConfig:
    """``trainer:`` — Lightning Trainer settings (NxDT names)."""

    devices: int = 1  # processes per node (torchrun --nproc_per_node)
    num_nodes: int = 1  # number of nodes; world size = devices * num_nodes
    accelerator: str = "auto"  # auto (neuron, then gpu, then cpu) | cpu | gpu | xla | neuron
    max_epochs: int = -1  # -1 = unlimited; training stops at max_steps
    max_steps: int = 1000  # number of optimizer steps
    log_every_n_steps: int = 10  # metrics are logged every N optimizer steps
    val_check_interval: Any = 1.0  # int = validate every N optimizer steps (as NxDT), float = fraction of an epoch
    check_val_every_n_epoch: Optional[int] = None  # None = validate on val_check_interval only
    num_sanity_val_steps: int = 0  # validation batches run before training
    limit_val_batches: Any = 1.0  # int = number of validation batches, float = fraction; 0 disables validation
    limit_test_batches: Any = 0.0  # int or fraction of test batches
    gradient_clip_val: Optional[float] = None  # clip the global (TP/DP-aware) gradient 2-norm to this value
    # a step whose loss / gradient norm is NaN or inf is not applied (Megatron's name; nxd_lc.lightning.nonfinite)
    check_for_nan_in_loss_and_grad: bool = True
    max_consecutive_nonfinite_steps: int = 1  # the run stops (non-zero exit) after this many such steps in a row
    enable_progress_bar: bool = True  # show Lightning's progress bar on rank 0
    lnc: Optional[int] = None  # Trainium2 logical NeuronCore config (Trainium issue)
    sequential_move_factor: Optional[int] = None  # ranks per node that build / move the model at a time (None: all)


@dataclass
class CheckpointCallbackParams:
    """``exp_manager.checkpoint_callback_params:`` — Lightning ModelCheckpoint settings."""

    monitor: Optional[str] = "step"  # logged metric that ranks checkpoints for save_top_k
    save_top_k: int = 1  # keep the best k checkpoints by monitor (-1 = all)
    mode: str = "max"  # max | min for monitor
    save_last: bool = False  # also keep a checkpoint tagged 'last'
    filename: str = "{step}-{consumed_samples}"  # tag pattern; {step} and {consumed_samples} are filled in
    model_parallel_size: Optional[int] = None  # informational in NxDT; must equal TP * PP when set
    every_n_train_steps: Optional[int] = None  # save every N optimizer steps
    use_master_weights_in_ckpt: bool = False  # save the fp32 master weights as the model weights (needs master weights)


@dataclass
class RetrievalEvalConfig:
    """``exp_manager.retrieval_eval:`` — passkey / needle-in-a-haystack accuracy while training
    (:mod:`nxd_lc.eval.retrieval`; haystacks from the held-out split), logged as ``retrieval/<task>/<scoring>@<L>``."""

    every_n_steps: int = 0  # evaluate every N optimizer steps (0: off)
    tasks: List[str] = field(default_factory=lambda: ["passkey"])  # of nxd_lc.eval.retrieval.TASKS
    lengths: List[int] = field(default_factory=list)  # context lengths in tokens ([] = data.seq_length)
    depths: List[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # needle depths in [0, 1]
    num_samples: int = 2  # samples per (length, depth) cell
    scorings: List[str] = field(default_factory=lambda: ["rank"])  # rank (log-likelihood) and/or generate (greedy)
    num_candidates: int = 10  # candidates ranked per sample
    seed: int = 0  # sample seed (the same samples at every evaluation)


@dataclass
class ExpManagerConfig:
    """``exp_manager:`` — logging directories, checkpointing and resume."""

    log_local_rank_0_only: bool = True  # only local rank 0 writes the text log file
    create_tensorboard_logger: bool = True  # write TensorBoard event files under the log dir
    explicit_log_dir: Optional[str] = None  # log dir used as is (overrides exp_dir/name)
    exp_dir: Optional[str] = None  # base dir; log dir = exp_dir/name (default ./nxd_lc_runs)
    name: str = "default"  # experiment name, a sub-directory of exp_dir
    resume_if_exists: bool = True  # resume from the newest complete checkpoint in the log dir
    resume_ignore_no_checkpoint: bool = True  # with resume_if_exists: start fresh when none exists (else error)
    resume_allow_changed_corpus: bool = False  # resume although the training files changed (repacked: other order)
    create_checkpoint_callback: bool = True  # save checkpoints
    checkpoint_callback_params: CheckpointCallbackParams = field(default_factory=CheckpointCallbackParams)
    log_parameter_norm: bool = False  # log the global parameter 2-norm
    log_gradient_norm: bool = False  # log the global gradient 2-norm (before clipping)
    enable_recovery_time_instrumentation: bool = False  # log process start -> first step, by phase (NxDT key)
    save_xser: bool = True  # write model/optim shards in xser format (one file per tensor)
    load_xser: bool = True  # read xser shards (auto-detected per checkpoint when false/true mismatch)
    # read every checkpoint / adapter / cache file with torch's restricted unpickler (a file naming any other global is
    # refused, nothing in it runs); false: full unpickling of a trusted legacy checkpoint (warned)
    checkpoint_weights_only: bool = True
    save_bf16: bool = False  # cast floating model weights to bf16 in the saved checkpoint
    async_checkpointing: bool = False  # step waits for a host copy only; files are written in a background thread
    # signals that make every rank save a checkpoint at the next step boundary and exit 0 ([] = Lightning's default)
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    resume_from_checkpoint: Optional[str] = None  # explicit checkpoint dir (<root>/<tag>) to resume from
    # KV-replica layout of a loaded checkpoint that records none (written by NxD's converter or trainer):
    # auto (the run's distributed_strategy.kv_replica_layout, as NxD's loader assumes) | interleaved | adjacent
    checkpoint_kv_replica_layout: str = "auto"
    ckpt_ptl_version: Optional[str] = None  # PTL version of a resumed checkpoint recording none (Lightning migrates it)
    retrieval_eval: RetrievalEvalConfig = field(default_factory=RetrievalEvalConfig)  # passkey / NIAH during training


@dataclass
class DistributedStrategyConfig:
    """``distributed_strategy:`` — parallel layout; rank order is NxD's [PP, DP, CP, TP]."""

    tensor_model_parallel_size: int = 1  # TP degree
    pipeline_model_parallel_size: int = 1  # PP degree: pipeline stages (1F1B on torch.distributed.pipelining)
    virtual_pipeline_model_parallel_size: int = 1  # stages per pipeline rank (>1: interleaved 1F1B)
    context_parallel_size: int = 1  # CP degree (long-context issue; must be 1 now)
    zero1: bool = False  # shard optimizer state and master weights over DP x CP (ZeRO-1)
    sequence_parallel: bool = False  # split activations outside the TP region along the sequence
    kv_replicator: int = 1  # replicate each KV head this many times so every TP rank holds whole heads
    # where KV replicas live over the TP ranks, as NxD lays them out: interleaved (Trn1: K0 K1 K0 K1, query heads
    # reordered) | adjacent (Trn2 / Trn3: K0 K0 K1 K1) | auto (as NxD chooses: the platform; adjacent on the native
    # device and with trainer.lnc 2, else interleaved, NxD's default)
    kv_replica_layout: str = "auto"
    context_parallel_algo: str = "ring"  # ring (load-balanced ring attention) | ulysses (all-to-all over heads)
    expert_model_parallel_size: int = 1  # EP degree: experts sharded over EP ranks carved from DP (NxD layout)
    token_shuffle_group_size: int = 1  # NxD MoE token shuffling over this many DP ranks (only 1: no shuffling)


@dataclass
class TokenizerConfig:
    """``data.tokenizer:`` — where the tokenizer comes from."""

    type: Optional[str] = None  # path to an HF tokenizer dir, or 'bytelevel_bpe' to train one on the corpus
    vocab_size: int = 8192  # vocab size when training a byte-level BPE
    train_max_bytes: int = 16_000_000  # corpus bytes used to train the BPE (first files in sorted order)
    cache_dir: Optional[str] = None  # where trained tokenizers / tokenized corpora are cached (./.cache/nxd_lc)
    chat_template: Optional[str] = "default"  # alignment: default (the tokenizer's own) | null (concat) | jinja
    library: Optional[str] = None  # null (type: HF dir | bytelevel_bpe) | huggingface (HF dir) | megatron (see README)
    model: Optional[str] = None  # SentencePiece model file (NeMo's tokenizer_model; not supported yet)
    vocab_file: Optional[str] = None  # library megatron, type GPT2BPETokenizer: the GPT-2 vocab.json
    merge_file: Optional[str] = None  # library megatron, type GPT2BPETokenizer: the GPT-2 merges.txt
    delimiter: Optional[str] = None  # NeMo's tabular tokenizer (not supported yet)
    sentencepiece_legacy: bool = False  # NeMo's sentencepiece library (true: not supported yet)
    use_fast: Optional[bool] = None  # HF AutoTokenizer use_fast (unset: true); text tokenization needs a fast one


#: Effective values of the ``data`` keys whose schema default is None, so that validation can tell a key that was
#: set from one that was not (pretraining-only keys in an alignment run and the reverse are errors). Readers use
#: :meth:`DataConfig.resolved`.
DATA_KEY_DEFAULTS: Dict[str, Any] = {"val_fraction": 0.05, "text_key": "text", "cross_document_attention": False,
                                     "input_key": "input", "output_key": "output"}

#: Effective values of the Megatron indexed-data keys (``data.data_prefix`` runs only; see
#: :mod:`nxd_lc.data.megatron_dataset`); any of them set without ``data.data_prefix`` is an error.
MEGATRON_DATA_KEY_DEFAULTS: Dict[str, Any] = {
    "index_mapping_dir": None, "data_impl": "mmap", "splits_string": "969,30,1", "skip_warmup": True,
    "dataloader_type": "single", "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
    "validation_drop_last": True, "no_seqlen_plus_one_input_tokens": False, "pad_samples_to_global_batch_size": False}
DATA_KEY_DEFAULTS.update({k: v for k, v in MEGATRON_DATA_KEY_DEFAULTS.items() if v is not None})


@dataclass
class DataConfig:
    """``data:`` — batch sizes and the corpus (pretraining) or the records (alignment)."""

    micro_batch_size: int = 1  # sequences per rank per forward pass
    global_batch_size: int = 1  # sequences per optimizer step over all DP ranks (sets grad accumulation)
    train_dir: Optional[str] = None  # dir/glob of text files, a .jsonl file, or a datasets save_to_disk dir
    val_dir: Optional[str] = None  # same kinds as train_dir; None = held-out split of the train corpus
    builtin_corpus: Optional[str] = None  # pretraining: 'python_stdlib', this interpreter's stdlib sources
    val_fraction: Optional[float] = None  # pretraining: share of files held out when val_dir is None (unset: 0.05)
    file_glob: str = "**/*"  # pattern applied inside a train_dir/val_dir directory of text / .jsonl files
    text_key: Optional[str] = None  # pretraining: jsonl / datasets column with the document text (unset: text)
    seq_length: Optional[int] = None  # training tokens per sequence, <= model.encoder_seq_length (default: equal)
    num_workers: int = 0  # DataLoader worker processes
    shuffle: bool = True  # seeded shuffle of packed sequences (data_prefix: of documents and samples; seed: top-level)
    cross_document_attention: Optional[bool] = None  # pretraining: true attends across packed documents (unset: false)
    # pretraining: weighted sources [{source: corpus | <dir/file like train_dir> | synthetic, weight: w, ...}]
    # (synthetic: tasks, num_samples, min_length; see nxd_lc.data.mixture / nxd_lc.data.synthetic)
    mixture: Optional[List[Dict[str, Any]]] = None
    length_upsampling: Optional[Dict[str, Any]] = None  # pretraining: {min_tokens, factor}: repeat long docs (ProLong)
    # pretraining: staged lengths [{until_step, seq_length, micro_batch_size?, rope_scaling?}] (nxd_lc.data.curriculum)
    curriculum: Optional[List[Dict[str, Any]]] = None
    dev_choose_samples: Optional[int] = None  # alignment: keep only the first N records of train_dir / val_dir
    input_key: Optional[str] = None  # alignment (NxDT SFT records): key of the prompt text (unset: input)
    output_key: Optional[str] = None  # alignment (NxDT SFT records): key of the response text (unset: output)
    # NxDT's older SFT layout (nxd_lc.config.sft_style_layout): both keys are consumed when the config is loaded
    use_sft_style_data_module: Optional[bool] = None  # NxDT's old SFT layout: true = model_alignment_strategy.sft
    packing: Optional[bool] = None  # NxDT's old SFT layout: read as model_alignment_strategy.sft.packing
    # pretraining, Megatron indexed data (nxd_lc.data.megatron_dataset): the <prefix>.bin/.idx files, as a prefix,
    # a blend [w1, prefix1, w2, prefix2, ...], or {train: ..., validation: ..., test: ...} (then no splits_string)
    data_prefix: Optional[Any] = None
    index_mapping_dir: Optional[str] = None  # data_prefix: dir of the cached sample indices (unset: beside each prefix)
    data_impl: Optional[str] = None  # data_prefix: indexed format; only 'mmap' (unset: mmap)
    splits_string: Optional[str] = None  # data_prefix: train,validation,test shares of the documents (unset: 969,30,1)
    skip_warmup: Optional[bool] = None  # data_prefix: false reads each .idx/.bin through once (page cache) at setup
    dataloader_type: Optional[str] = None  # data_prefix: single (one seeded order) | cyclic (reshuffled each epoch)
    reset_position_ids: Optional[bool] = None  # data_prefix: position ids restart after each EOD (unset: false)
    reset_attention_mask: Optional[bool] = None  # data_prefix: no attention across an EOD (unset: false)
    eod_mask_loss: Optional[bool] = None  # data_prefix: no loss at positions whose input is EOD (unset: false)
    validation_drop_last: Optional[bool] = None  # data_prefix: false pads the last partial validation step (unset: on)
    no_seqlen_plus_one_input_tokens: Optional[bool] = None  # data_prefix: S-token samples, last label masked
    pad_samples_to_global_batch_size: Optional[bool] = None  # data_prefix: pad validation to whole global batches
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def resolved(self) -> DataConfig:
        """A copy with every unset key of :data:`DATA_KEY_DEFAULTS` at its effective value (what readers use)."""
        unset = {k: v for k, v in DATA_KEY_DEFAULTS.items() if getattr(self, k, None) is None}
        return dataclasses.replace(self, **unset)


@dataclass
class FusionsConfig:
    """``model.fusions:`` — kernel choices."""

    softmax: bool = True  # NEURON_FUSE_SOFTMAX on Neuron; CPU/CUDA use torch's softmax either way
    flash_attention: bool = True  # True: SDPA flash path (NKI on Trainium); False: eager softmax(QK^T) attention
    ring_attention: Optional[bool] = None  # NxDT: true = ring CP (context_parallel_algo ring); false + CP>1: ulysses
    # kernel of each element-wise part: auto | torch (eager reference, what compile fuses) | liger (Liger-Kernel, CUDA)
    rms_norm: str = "auto"  # RMSNorm
    rope: str = "auto"  # RoPE application to q / k
    swiglu: str = "auto"  # silu(gate) * up
    cross_entropy: str = "auto"  # lm head + loss: liger = fused linear cross-entropy (TP 1, no tiled_loss_chunk_size)


@dataclass
class SchedConfig:
    """``model.optim.sched:`` — learning-rate schedule (NeMo names)."""

    name: str = "LinearAnnealingWithWarmUp"  # NeMo name: LinearAnnealingWithWarmUp, CosineAnnealing, WarmupPolicy, ...
    warmup_steps: int = 0  # linear warm-up from 0 to lr over this many steps
    max_steps: Optional[int] = None  # schedule length; usually ${trainer.max_steps}
    constant_steps: int = 0  # CosineAnnealing: final steps held at min_lr after the cosine decay (NeMo)
    min_lr: float = 0.0  # floor of the annealed learning rate
    hold_steps: int = 0  # WarmupHoldPolicy: steps held at lr after warm-up (NeMo hold_steps)
    d_model: Optional[int] = None  # NoamAnnealing: model width; lr * d_model^-0.5 * min(s^-0.5, s * W^-1.5)
    step_size: Optional[int] = None  # StepLR: multiply lr by gamma every step_size steps (torch StepLR)
    gamma: Optional[float] = None  # StepLR (default 0.1) / ExponentialLR (required): decay factor


@dataclass
class OptimConfig:
    """``model.optim:`` — optimizer (NeMo names) and its schedule."""

    name: str = "adamw"  # NeMo name: adamw, adamw_fp32OptState, adam, sgd, adadelta, adamax, adagrad, rmsprop, ...
    lr: float = 1e-4  # peak learning rate
    weight_decay: float = 0.0  # decoupled (adamw) or L2 (adam/sgd) weight decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam betas
    eps: float = 1e-8  # Adam epsilon
    momentum: float = 0.0  # SGD momentum
    capturable: bool = False  # torch.optim capturable flag (CUDA graphs / XLA)
    amsgrad: bool = False  # adam / adamw / novograd: use the running max of the second moment
    rho: float = 0.9  # adadelta: decay of the squared-gradient and squared-update averages
    lr_decay: float = 0.0  # adagrad: lr / (1 + (step - 1) * lr_decay)
    initial_accumulator_value: float = 0.0  # adagrad: starting value of the squared-gradient sum
    alpha: float = 0.99  # rmsprop: smoothing constant of the squared-gradient average
    centered: bool = False  # rmsprop: normalise by the centred (variance) estimate
    etas: List[float] = field(default_factory=lambda: [0.5, 1.2])  # rprop: (decrease, increase) factors
    step_sizes: List[float] = field(default_factory=lambda: [1e-6, 50.0])  # rprop: (min, max) step size
    grad_averaging: bool = False  # novograd: scale the normalised gradient by (1 - beta1)
    decay_rate: float = -0.8  # adafactor: second-moment decay exponent, beta2_t = 1 - t^decay_rate
    clip_threshold: float = 1.0  # adafactor: update RMS clipping threshold (torch Adafactor d)
    sched: SchedConfig = field(default_factory=SchedConfig)


@dataclass
class MoEConfig:
    """``model.moe:`` — mixture-of-experts blocks (NxDT's keys; a Mixtral ``model_config`` needs them)."""

    num_experts: Optional[int] = None  # experts per MoE layer (config.json num_local_experts when null)
    frequency: int = 1  # layer i is a MoE layer when i % frequency == 0 (1: every layer)
    dropout: float = 0.0  # NxDT passes it as attention dropout; only 0 is supported
    capacity_factor: Optional[float] = None  # slots per expert vs a uniform load; null / <= 0: no limit
    dropless: bool = False  # true: no token is ever dropped (capacity_factor ignored)
    routing_algorithm: str = "top_k"  # top_k (sinkhorn: not supported yet)
    top_k: Optional[int] = None  # experts per token (config.json num_experts_per_tok when null)
    output_router_logits: Optional[bool] = None  # add the load-balancing loss (config.json's when null)
    router_aux_loss_coef: Optional[float] = None  # weight of the load-balancing loss (config.json's when null)
    normalize_top_k_affinities: bool = True  # renormalise the kept top-k affinities to sum 1 (Mixtral)
    router_activation: str = "softmax"  # softmax | sigmoid: NxD applies it in the sinkhorn router only (top_k: softmax)
    sinkhorn_iterations: Optional[int] = None  # sinkhorn router only (not supported yet)
    sinkhorn_tol: Optional[Any] = None  # sinkhorn router only (not supported yet); NxDT's files write the string None


@dataclass
class ModelConfig:
    """``model:`` — the decoder, built from an HF config.json with NxDT's YAML overrides."""

    model_config: Optional[str] = None  # path to an HF config.json (model_type llama or mixtral)
    hf_weights_dir: Optional[str] = None  # HF safetensors dir loaded before training, each rank reading its TP shard
    hf_conversion_cache: bool = False  # cache hf_weights_dir converted to this layout; later starts load the cache
    hf_conversion_cache_dir: Optional[str] = None  # where (default <log_dir>/hf_converted)
    force_reconvert_from_hf: bool = False  # convert hf_weights_dir again and overwrite the cache entry
    encoder_seq_length: Optional[int] = None  # the model's sequence length (<= max positions; judges RoPE scaling)
    max_position_embeddings: Optional[int] = None  # overrides config.json max_position_embeddings
    num_layers: Optional[int] = None  # overrides config.json num_hidden_layers
    hidden_size: Optional[int] = None  # overrides config.json hidden_size
    rope_theta: Optional[float] = None  # overrides config.json rope_theta
    qkv_linear: bool = True  # use GQAQKVColumnParallelLinear (needed when KV heads < TP)
    fuse_qkv: bool = True  # one fused [q+2kv, hidden] QKV weight
    hf_config_overrides: Optional[Dict[str, Any]] = None  # merged over config.json (e.g. rope_scaling: {...})
    tiled_loss_chunk_size: Optional[int] = None  # tokens per chunk of the tiled vocab-parallel CE (None: untiled)
    tiled_mlp_chunk_size: Optional[int] = None  # tokens per chunk of the tiled MLP (None: untiled)
    compile: Any = "auto"  # regional torch.compile of each decoder layer: true | false | auto (CUDA only for now)
    enable_cuda_graph: bool = False  # compiled layers on CUDA replay CUDA graphs (torch.compile mode reduce-overhead)
    weight_init_only: bool = False  # with exp_manager.resume_from_checkpoint: load model weights only (NxDT)
    use_cpu_initialization: bool = True  # init full weights on CPU with the seed, then keep the TP shard
    activations_checkpoint_granularity: Optional[str] = None  # null | full (each layer) | selective
    activations_checkpoint_recompute: Optional[List[str]] = None  # module class names recomputed with 'selective'
    activations_checkpoint_save_attention: bool = False  # checkpointed modules keep attention outputs (no O(S^2) redo)
    activations_checkpoint_method: Optional[str] = None  # with 'full': null/uniform (every layer) | block (first N)
    activations_checkpoint_num_layers: Optional[int] = None  # 'block': layers checkpointed per pipeline stage
    activations_offload: bool = False  # with 'full': recomputed layers' inputs (+ kept attention) in host memory
    activations_memory_budget: Optional[Any] = None  # fraction in (0, 1] or '40GiB': nxd_lc picks the memory plan
    pipeline_cuts: Optional[List[str]] = None  # last layer of each pipeline stage but the last, e.g. [model.layers.18]
    fusions: FusionsConfig = field(default_factory=FusionsConfig)
    transpose_nki_inputs: bool = True  # NKI flash attention takes q/k/v as [B,H,D,S] (True) or [B,H,S,D] (False)
    do_layer_norm_weight_decay: bool = False  # False: no weight decay on norm weights and biases
    moe: Optional[MoEConfig] = None  # mixture of experts (model_type mixtral); null for dense models
    optim: OptimConfig = field(default_factory=OptimConfig)
    # ---- model_source: megatron: the architecture from these keys (null: NeMo's default; nxd_lc.models.megatron)
    ffn_hidden_size: Optional[int] = None  # MLP intermediate size (required)
    num_attention_heads: Optional[int] = None  # query heads (required)
    num_kv_heads: Optional[int] = None  # key/value heads (GQA; null: num_attention_heads)
    kv_channels: Optional[int] = None  # per-head size (null: hidden_size / num_attention_heads)
    init_method_std: Optional[float] = None  # std of the normal weight init (0.02)
    use_scaled_init_method: Optional[bool] = None  # output layers' std / sqrt(2 * num_layers) (true)
    hidden_dropout: Optional[float] = None  # dropout on embeddings and residual branches (0.1)
    attention_dropout: Optional[float] = None  # dropout on attention probabilities (0.1)
    ffn_dropout: Optional[float] = None  # dropout on the MLP activation (0.0)
    apply_query_key_layer_scaling: Optional[bool] = None  # fp16 overflow guard; a numerical no-op here (true)
    normalization: Optional[str] = None  # layernorm | rmsnorm (layernorm)
    layernorm_epsilon: Optional[float] = None  # norm epsilon (1e-5)
    make_vocab_size_divisible_by: Optional[int] = None  # vocab padded to a multiple of this x TP (128)
    persist_layer_norm: Optional[bool] = None  # Apex persistent LayerNorm kernel; no meaning here (false)
    share_embeddings_and_output_weights: Optional[bool] = None  # tie the lm head to the embedding (true)
    position_embedding_type: Optional[str] = None  # learned_absolute | rope (learned_absolute)
    rotary_percentage: Optional[float] = None  # share of each head's dims rotated by RoPE (1.0)
    activation: Optional[str] = None  # gelu | swiglu (gelu)
    transformer_block_type: Optional[str] = None  # pre_ln (post_ln, normformer, gpt_j: not supported yet)
    has_bias: Optional[bool] = None  # biases in every linear layer of the blocks (true)
    sliding_window_size: Optional[int] = None  # Mistral sliding-window attention, in keys (null: none)


@dataclass
class PrecisionConfig:
    """``precision:`` — numeric mode; modes -> dtypes in :mod:`nxd_lc.precision.policy` and the README."""

    type: str = "fp32"  # bf16SR | fp32 | autocast | mixed_precision | mixed_precisionSR | manual
    master_weights: bool = False  # manual: fp32 master weights in the optimizer
    fp32_grad_acc: bool = False  # manual: fp32 gradient accumulation buffers
    xla_use_bf16: str = "0"  # manual: '1' = bf16 parameters (NxDT's XLA_USE_BF16; nxd_lc casts, sets the variable 0)
    xla_downcast_bf16: str = "0"  # manual: '1' = bf16 parameters (NxDT's XLA_DOWNCAST_BF16; likewise an explicit cast)
    neuron_rt_stochastic_rounding_en: str = "0"  # manual: NEURON_RT_STOCHASTIC_ROUNDING_EN
    parallel_layers_reduce_dtype: Optional[str] = None  # dtype of TP/SP collectives (fp32 | bf16)
    fp32_grads_cc: bool = False  # data-parallel gradient all-reduce in fp32 (bf16 gradients up-cast for it)


@dataclass
class NxdConfig:
    """The whole run: NxDT's sections plus its top-level runtime keys."""

    name: str = "nxd_lc"  # run name
    model_source: str = "hf"  # hf (model.model_config) | megatron (architecture from the model: keys)
    seed: int = 1234  # seeds weights init, data shuffling and dropout
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    distributed_strategy: DistributedStrategyConfig = field(default_factory=DistributedStrategyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model_alignment_strategy: Optional[ModelAlignmentStrategyConfig] = None  # sft | dpo | orpo fine-tuning
    compiler_flags: str = ""  # appended to NEURON_CC_FLAGS
    compiler_cache_url: str = "./compiler_cache"  # NEURON_COMPILE_CACHE_URL (+ TORCH_NEURONX_NEFF_CACHE_DIR)
    async_exec_max_inflight_requests: Optional[int] = None  # NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS
    bucket_size_collectives: Optional[int] = None  # MiB per DP gradient all-reduce bucket (unset: 64); BUCKET_CAP_MB
    neuron_rt_exec_timeout: Optional[int] = None  # NEURON_RT_EXEC_TIMEOUT (seconds)
    neuron_experimental_compress_rg: Optional[bool] = None  # NEURON_EXPERIMENTAL_COMPRESS_RG
    dry_run: bool = False  # validate the config, print it with the effective environment, and exit
    prewarm: bool = False  # graph-extraction pass: few steps, no checkpoints/loggers, writes the graph manifest


#: Accepted spellings that map to a canonical key, as (dotted alias, dotted canonical key).
KEY_ALIASES: tuple[tuple[str, str], ...] = (
    ("aync_exec_max_inflight_requests", "async_exec_max_inflight_requests"),  # NxDT's own misspelling
    *ALIGNMENT_KEY_ALIASES,
)

#: Keys nxd_lc read at an earlier place, as (dotted old place, dotted canonical key in another section).
MOVED_KEYS: tuple[tuple[str, str], ...] = (
    ("model.peft", "model_alignment_strategy.peft"),  # NxDT puts LoRA beside sft / dpo / orpo
)


#: ``model.activations_checkpoint_method`` values (NeMo's key; Megatron-core's ``recompute_method``).
CHECKPOINT_METHODS: tuple[Optional[str], ...] = (None, "uniform", "block")


def checkpoint_method_problems(granularity: Optional[str], method: Optional[str],
                               num_layers: Optional[int]) -> List[str]:
    """Problems (empty list: none) of ``model.activations_checkpoint_method`` / ``..._num_layers`` with the
    given granularity, as NeMo / Megatron-core define the keys (``recompute_method``, ``recompute_num_layers``):

    * ``block`` with ``full`` granularity: the first ``num_layers`` decoder layers of each pipeline stage are
      checkpointed, the rest keep their activations (``num_layers`` >= 0; more than a stage holds means all).
    * ``uniform`` (or null): every layer is checkpointed on its own; ``num_layers`` must be null or 1 (NeMo's
      grouping of several layers into one checkpoint is not supported yet).

    ``method`` must already be one of :data:`CHECKPOINT_METHODS` (the choice check names bad values).
    """
    p: List[str] = []
    key = "model.activations_checkpoint_num_layers"
    if method is not None and granularity != "full":
        p.append(f"model.activations_checkpoint_method: {method!r} applies to "
                 f"model.activations_checkpoint_granularity full (it is {granularity!r}), as in NeMo/Megatron; "
                 "set the granularity to full or the method to null")
    if method == "block":
        if num_layers is None or num_layers < 0:
            p.append(f"{key}: 'block' needs the number of decoder layers to checkpoint per pipeline stage "
                     f"(an int >= 0), got {num_layers!r}")
    elif num_layers is not None and num_layers != 1:
        p.append(f"{key}: {num_layers} with method {method!r}: grouping several layers into one checkpoint "
                 "(NeMo's 'uniform' with num_layers > 1) is not supported yet; use method block to "
                 "checkpoint only the first N layers, or num_layers 1 / null to checkpoint every layer")
    return p


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as ``nxd_lc_schema`` (usable in a defaults list)."""
    cs = ConfigStore.instance()
    cs.store(name="nxd_lc_schema", node=NxdConfig)
