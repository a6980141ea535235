"""The synchronous engine core: requests in, one `step()` at a time, tokens out.

Owns the model, the KV pool, the block manager and the scheduler. Also the disaggregation
primitives: a prefill-only request ends with its blocks held under a KV handle (a `Lease`),
`export_kv` reads them into a payload, `import_kv` on another engine writes them and decoding
continues. An embedding request (`add_embedding_request`) is scheduled like any prefill, samples
nothing, and finishes with its prompt's final hidden states pooled (engine.pooling) and its blocks freed.
Not thread-safe: engine.async_engine drives it from one thread; the one exception is
`open_export`, which transports call from their own threads so that a decode site's pull never
waits for the prefill site's step in progress (a long prefill chunk).

The model runs on an executor: one `ModelShard` in this process, or with tensor/pipeline/expert
parallelism a `ParallelExecutor` (engine.parallel) whose ranks each hold part of it. Either way
the scheduler, block manager and sampler are here, once. With pipeline_parallel_size > 1 up to
that many batches are in flight, each stage working on a different one; a sequence is in at most
one of them, so each sequence's tokens are computed exactly as in one batch at a time.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.compression import WEIGHT_MODES
from engine.config import ModelConfig, load_config, read_json, token_ids
from engine.errors import CheckpointError, DeviceError, InvalidRequestError, UnknownHandleError
from engine.kv_export import KVExport, KVMap
from engine.kv_transfer import KVLayout, KVPayload
from engine.fingerprint import model_fingerprint
from engine.grammar import GrammarCompiler
from engine.loader import has_lm_head, load_model, resolve_dtype, stores_lm_head
from engine.memory import check_fits
from engine.ngram import MAX_PREDICTION_TOKENS
from engine.parallel.layout import ParallelLayout
from engine.pooling import Pooling, PoolingState, load_pooling
from engine.runner import ForwardResult, StepInputs, prepare_step
from engine.sampling import SampledToken, SamplingParams, allowed_from_bitmask, sample
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus
from engine.shard import ModelShard, max_model_len
from engine.speculative import Speculator
from engine.speculative_config import SpeculativeConfig
from engine.tokenizer import ChatTokenizer
from engine.step_totals import StepPhases, StepTotals

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    device: str = "auto"                 # auto: cuda if available, else cpu
    dtype: str = "auto"                  # auto: bfloat16 on GPU, float32 on CPU
    block_size: int = 16
    kv_cache_bytes: int | None = None    # explicit KV budget per rank; default 256 MiB on CPU
    gpu_memory_utilization: float = 0.9  # GPU: fraction of free memory (after weights) for KV
    tensor_parallel_size: int = 1        # ranks splitting each layer's heads and MLP (one process and device each)
    pipeline_parallel_size: int = 1      # stages splitting the layers (max(tp, ep) ranks each)
    # ranks splitting each mixture-of-experts layer's experts: the stage's TP ranks (ep == tp), or
    # ep ranks that each repeat the attention (tp == 1)
    expert_parallel_size: int = 1
    enable_cuda_graphs: bool = True      # GPU: replay decode-only steps from graphs captured at start-up
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    kv_handle_ttl_s: float = 30.0
    kv_chunk_bytes: int = 1 << 20        # one exported KV chunk: small enough to pipeline gather and send
    show_progress: bool = True
    # For checkpoints from `edgefire compress`: decompress_on_load decodes every weight while loading;
    # compressed_in_memory keeps the MLP weights compressed and gives the memory saved to the KV pool.
    weight_mode: str = "decompress_on_load"
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine.speculative); None: off

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.weight_mode not in WEIGHT_MODES:
            raise ValueError(f"weight_mode must be one of {', '.join(WEIGHT_MODES)}, got {self.weight_mode!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        self.layout.validate()
        if self.speculative is not None:
            self.speculative.validate()
            if self.pipeline_parallel_size > 1:
                raise ValueError("speculative decoding does not run with pipeline_parallel_size > 1 (batches in "
                                 "flight would verify proposals made before the previous batch's tokens were known); "
                                 "use tensor parallelism or turn speculative off")
            if self.speculative.method == "draft" and self.layout.world_size > 1:
                raise ValueError("a draft model runs in one process: use speculative method 'ngram' with tensor "
                                 "parallelism, or a single-process engine")

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tensor_parallel_size, self.pipeline_parallel_size, self.expert_parallel_size)


@dataclass(slots=True)
class StepOutput:
    """What one request produced in one step (at most one token)."""

    request_id: str
    token: SampledToken | None
    finished: bool = False
    finish_reason: str | None = None     # stop | length | abort
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_handle: str | None = None         # set when a prefill-only request finishes
    # Proposals from the request's predicted output verified so far: kept, and not kept (running totals)
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    embedding: torch.Tensor | None = None   # an embedding request's pooled vector (float32, CPU); token is None


@dataclass(slots=True)
class Lease:
    """A finished prefill's blocks, held under a KV handle until read and released, or expired."""

    seq: Sequence
    expires_at: float                # monotonic; an open export holds it past this
    num_readers: int = 0             # open exports reading the blocks
    released: bool = False           # released while read: freed when the last reader closes
    ended: bool = False              # its release is queued: no new reader may open it meanwhile


@dataclass(slots=True)
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int
    block_size: int
    num_running: int
    num_waiting: int
    num_pinned_handles: int
    inflight_prefill_tokens: int
    inflight_decode_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    # The load the decode rate was measured under (averaged like it): sequences per decode step and
    # the KV tokens those sequences held, which the step read. Routers calibrate their cost model by it.
    decode_batch_size: float
    decode_kv_tokens: float
    num_preemptions: int
    prefix_cache_hit_tokens: int
    steps: StepTotals = field(default_factory=StepTotals)  # running totals since start
    # Free blocks the waiting requests will take when the scheduler admits them (Scheduler.num_blocks_waiting):
    # counted free until then, yet no new request can have them
    num_blocks_waiting: int = 0
    num_kv_blocks_from_compression: int = 0   # KV blocks paid for by compressed_in_memory's savings
    num_gpus: int = 0                    # GPUs the engine's ranks run on (0: CPU)
    gpu_indices: tuple[int, ...] = ()    # their device indices, as placed (a site counts shared ones once)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    # Speculative decoding since start: proposed tokens the model verified, those it kept, and the
    # sequence-steps that verified proposals (kept / verifications + 1: tokens per such step).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_speculative_verifications: int = 0


@dataclass(slots=True)
class _Batch:
    """A batch whose forward is in flight (pipeline parallelism)."""

    scheduled: list[ScheduledSeq]
    inputs: StepInputs
    started: float


@dataclass(slots=True)
class _Rate:
    """Exponentially averaged tokens per second of busy time."""

    value: float = 0.0
    alpha: float = 0.2

    def update(self, tokens: int, seconds: float) -> None:
        if tokens and seconds > 0:
            rate = tokens / seconds
            self.value = rate if not self.value else (1 - self.alpha) * self.value + self.alpha * rate


@dataclass(slots=True)
class _Average:
    """Exponentially averaged value, weighted like _Rate."""

    value: float = 0.0
    alpha: float = 0.2

    def update(self, value: float) -> None:
        self.value = value if not self.value else (1 - self.alpha) * self.value + self.alpha * value


def _pick_device(name: str) -> torch.device:
    """The configured device ("auto": a GPU when torch sees one); DeviceError for one this machine lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DeviceError(f"device {name!r} is not a device torch knows ({exc}); use auto, cpu or cuda[:N]") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"device {name!r}: this machine has no GPU torch can use (no CUDA device, or a "
                              f"CPU-only torch build); use device auto or cpu")
        if (device.index or 0) >= count:
            raise DeviceError(f"device {name!r}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise DeviceError(f"device {name!r}: the engine runs on cpu or cuda devices")
    return device


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.validate()
        self.model_dir = Path(model_dir)
        self.model_config: ModelConfig = load_config(self.model_dir)
        self.device = _pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.layout = config.layout
        self.layout.check_model(self.model_config)
        lm_head_stored = self.model_config.tie_word_embeddings and stores_lm_head(self.model_dir)
        self.weight_bytes = check_fits(self.model_config, self.dtype, self.device, config.kv_cache_bytes, self.layout,
                                       lm_head_stored)
        self.eos_token_ids = self._eos_token_ids()
        self._check_tokenizer_fits()
        self.fingerprint = model_fingerprint(self.model_dir)
        self.generates = has_lm_head(self.model_dir, self.model_config)
        self.pooling, self.pooling_error = self._pooling()
        if self.layout.world_size == 1:
            self.executor = self._local_executor()
        else:
            from engine.parallel.executor import ParallelExecutor
            self.executor = ParallelExecutor(self.model_dir, self.model_config, config, self.device, self.dtype)
        self.model = self.executor.model           # this process's part of it
        self.kv_map: KVMap = self.executor.kv_map  # where every layer's K/V live, in whichever process
        num_blocks = self.executor.num_blocks
        self.max_model_len = self.executor.max_model_len
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs), self.block_manager)
        self.pipeline_depth = self.layout.pp
        self._in_flight: deque[_Batch] = deque()
        self._busy: set[Sequence] = set()          # sequences in an in-flight batch
        self._ready: list[StepOutput] = []         # outputs of batches completed outside step()
        self._last_completed = 0.0
        self.sequences: dict[str, Sequence] = {}
        self.leases: dict[str, Lease] = {}   # kv_handle -> lease
        self._lease_lock = threading.Lock()  # open_export runs on transport threads
        self.prefill_rate = _Rate()
        self.decode_rate = _Rate()
        self.decode_batch_size = _Average()
        self.decode_kv_tokens = _Average()
        self.num_prefix_hit_tokens = 0
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.step_totals = StepTotals()
        self.step_phases = StepPhases()
        self.num_kv_blocks_from_compression = self.executor.num_kv_blocks_from_compression
        # Built without speculation configured too (pipeline parallelism aside): a request's predicted output
        # proposes tokens on any engine.
        self.speculator = self._speculator(num_blocks) if self.pipeline_depth == 1 else None
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB per rank, %s), max_model_len %d%s", num_blocks,
                 config.block_size, num_blocks * self.executor.bytes_per_block / 2**20, self.layout, self.max_model_len,
                 f"; {self.num_kv_blocks_from_compression} of them from the memory compressed_in_memory saves"
                 if self.num_kv_blocks_from_compression else "")
        self._log_longrope_choice()

    # -- set-up ------------------------------------------------------------------------------

    def _eos_token_ids(self) -> set[int]:
        """generation_config.json's eos_token_id where it has one, else config.json's."""
        path = self.model_dir / "generation_config.json"
        generation = read_json(path, required=False) or {}
        if "eos_token_id" in generation:
            eos = token_ids(generation["eos_token_id"], "eos_token_id", path)
        else:
            path, eos = self.model_dir / "config.json", self.model_config.eos_token_ids
        vocab = self.model_config.vocab_size
        outside = [token_id for token_id in eos if token_id >= vocab]
        if outside:   # the model could never produce it: generation would only ever stop at max_tokens
            raise CheckpointError(f"{path}: eos_token_id {outside[0]} is outside the model's vocabulary "
                                  f"(vocab_size {vocab} in config.json)")
        return set(eos)

    def _pooling(self) -> tuple[Pooling | None, str | None]:
        """The checkpoint's embedding pooling, or why it cannot pool: a generative model with a pooling
        configuration the engine cannot follow still generates; its embedding requests get the reason."""
        try:
            pooling = load_pooling(self.model_dir, self.model_config.hidden_size)
        except CheckpointError as exc:
            log.warning("embeddings are not served for this model: %s", exc)
            return None, str(exc)
        log.info("embeddings: %s%s", pooling.source, "" if self.generates else
                 "; the checkpoint has no LM head, so it serves embeddings only")
        return pooling, None

    def _check_tokenizer_fits(self) -> None:
        """The tokenizer files load as routers and `edgefire generate` load them (a bad chat template or special
        token fails here, not on every request), and every token id the tokenizer produces has a row in the
        model's embedding; a tokenizer larger than the model would have prompts with its last tokens refused
        as the client's fault."""
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():   # the engine runs on token ids; only those who tokenize need the file
            return
        vocab = self.model_config.vocab_size
        tokenizer = ChatTokenizer.from_dir(self.model_dir).tokenizer
        num_tokens = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if num_tokens > vocab:
            raise CheckpointError(f"{path} has token ids up to {num_tokens - 1}, but config.json's vocab_size is "
                                  f"{vocab}: the tokenizer does not belong to these weights")

    def _log_longrope_choice(self) -> None:
        """Which longrope factors every rank rotates by (CausalLM.serve_context chose them from max_model_len)."""
        rope = self.model_config.rope
        if rope.rope_type != "longrope":
            return
        original = rope.original_max_position_embeddings
        if rope.uses_long_factor(self.max_model_len):
            log.info("longrope: long_factor, as max_model_len %d exceeds the original context %d; sequences within "
                     "%d tokens rotate as transformers rotates a longer one (serve with max_model_len <= %d for "
                     "short_factor)", self.max_model_len, original, original, original)
        else:
            log.info("longrope: short_factor, as max_model_len %d is within the original context %d (every sequence "
                     "rotates as in transformers)", self.max_model_len, original)

    def _local_executor(self) -> ModelShard:
        cfg = self.config
        model = load_model(self.model_dir, self.model_config, self.device, self.dtype, cfg.show_progress,
                           cfg.weight_mode)
        shard = ModelShard(model, cfg)
        shard.allocate(shard.blocks_fit())
        shard.max_model_len = max_model_len(cfg, self.model_config.max_position_embeddings, shard.num_blocks)
        model.serve_context(shard.max_model_len)
        shard.capture_graphs(shard.max_model_len)
        return shard

    def _speculator(self, num_blocks: int) -> Speculator:
        spec = self.config.speculative
        if spec is None:  # no proposer of the site's own: only predicted outputs propose, with the default k
            return Speculator(SpeculativeConfig(), None, self.block_manager, self.config.max_num_batched_tokens,
                              self.eos_token_ids)
        if spec.method == "draft":
            from engine.draft import DraftProposer
            proposer = DraftProposer(spec.draft_model, self.model_dir, self.config, self.device, self.dtype, num_blocks)
        else:
            from engine.ngram import NgramProposer
            proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        return Speculator(spec, proposer, self.block_manager, self.config.max_num_batched_tokens, self.eos_token_ids)

    def shutdown(self) -> None:
        """Stop the other ranks (tensor/pipeline parallelism); a single-process engine holds nothing to stop."""
        if self.layout.world_size > 1:
            self.executor.shutdown()

    def check_ranks(self) -> None:
        """Raise RankFailedError once a rank of this engine has died, even while it is idle."""
        if self.layout.world_size > 1:
            self.executor.raise_if_failed()

    # -- requests ----------------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      generated_ids: list[int], prefill_only: bool, embedding: bool = False) -> Sequence:
        if request_id in self.sequences:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty; send at least one token")
        # refused before validate(), which reads every token id of the prediction
        max_prediction = min(MAX_PREDICTION_TOKENS, self.max_model_len)
        if isinstance(params.prediction_ids, (list, tuple)) and len(params.prediction_ids) > max_prediction:
            raise InvalidRequestError(f"the predicted output has {len(params.prediction_ids)} tokens; at most "
                                      f"{max_prediction} are taken (this model's context holds {self.max_model_len})")
        params.validate(self.model_config.vocab_size)
        vocab = self.model_config.vocab_size
        ids = [*prompt_ids, *generated_ids]
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise InvalidRequestError(f"token ids must be Python ints, got {bad!r} ({type(bad).__name__})")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary (size {vocab})")
        total = len(prompt_ids) + len(generated_ids)
        if embedding and total > self.max_model_len:
            raise InvalidRequestError(f"input has {total} tokens; this model's context holds {self.max_model_len}")
        if not embedding and total >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {total} tokens; this model's context holds {self.max_model_len} "
                                      f"including at least one generated token")
        if len(generated_ids) >= params.max_tokens:
            raise InvalidRequestError(f"{len(generated_ids)} tokens already generated reach max_tokens {params.max_tokens}")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        max_total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        seq = Sequence(request_id, prompt_ids, params, seed, max_total, prefill_only)
        seq.token_ids.extend(generated_ids)
        if params.grammar is not None:
            seq.matcher = self.grammar_compiler().matcher(params.grammar, generated_ids)
            if seq.matcher.done:
                raise InvalidRequestError("the tokens already generated complete the request's grammar; "
                                          "there is nothing left to generate")
        return seq

    def prepare_grammar(self, spec) -> None:
        """Compile and cache a request's grammar (InvalidRequestError when it does not compile). Safe on any
        thread: callers run it off the engine thread, so a large schema never stalls a step."""
        self.grammar_compiler().compile(spec)

    def grammar_compiler(self) -> GrammarCompiler:
        """Built on the first constrained request (only those need the tokenizer's token bytes)."""
        with self._grammar_lock:  # prepare_grammar may race the engine thread to build it
            if self._grammar_compiler is None:
                path = self.model_dir / "tokenizer.json"
                if not path.is_file():
                    raise InvalidRequestError("this model has no tokenizer.json, which constrained output "
                                              "(response_format, tool_choice) needs")
                # On a CPU the model's threads own the cores: masks are filled on this thread (see grammar).
                self._grammar_compiler = GrammarCompiler(path.read_text(encoding="utf-8"),
                                                         self.model_config.vocab_size, sorted(self.eos_token_ids),
                                                         num_threads=1 if self.device.type == "cpu" else None)
            return self._grammar_compiler

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    generated_ids: list[int] | None = None, prefill_only: bool = False) -> None:
        """Queue a request. generated_ids resumes a request whose first tokens were produced elsewhere."""
        if not self.generates:
            raise InvalidRequestError("this checkpoint has no LM head (a bare backbone saved for embeddings): it "
                                      "serves embeddings only")
        seq = self._new_sequence(request_id, list(prompt_ids), params, list(generated_ids or []), prefill_only)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        if self.speculator is not None:
            self.speculator.add(seq)

    def add_embedding_request(self, request_id: str, prompt_ids: list[int]) -> None:
        """Queue an embedding request: its prompt is prefilled (batched and chunked as any prefill), then its
        final hidden states are pooled and its blocks freed; the step that completes it outputs the vector."""
        if self.pooling is None:
            raise InvalidRequestError(f"this model cannot serve embeddings: {self.pooling_error}")
        params = SamplingParams(max_tokens=1, no_speculation=True)
        seq = self._new_sequence(request_id, list(prompt_ids), params, [], prefill_only=False, embedding=True)
        seq.max_total_tokens = seq.num_tokens
        seq.pooling = PoolingState(self.pooling)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        # A batch in flight still writes this sequence's K/V: its blocks are freed when that batch
        # completes, so nothing else can be given them (and overwritten by it) before.
        if seq.block_table and seq not in self._busy:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        if self.speculator is not None:
            self.speculator.release(seq)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight or self._ready)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One step: schedule, build inputs, run the model, sample, record. The single-device hot path."""
        clock = time.perf_counter
        began = clock()
        self.expire_handles()
        if self.pipeline_depth > 1:
            return self._pipelined_step()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        # speculation's proposals (an n-gram lookup, or the draft model's steps) count as scheduling
        num_drafts = self.speculator.plan(scheduled) if self.speculator is not None else 0
        started = clock()
        inputs = prepare_step(scheduled, self.config.block_size, self.device)
        prepared = clock()
        result = self.executor.run(inputs)
        logits = result.logits
        forwarded = clock()
        if num_drafts:
            emitted = self._verify(inputs, logits)
            sampled_at = clock()
            self._record_rates(scheduled, sampled_at - started, sum(len(tokens) - 1 for tokens in emitted))
            outputs = self._advance_speculative(scheduled, inputs, emitted)
        else:
            sampled = self._sample(inputs, logits)
            sampled_at = clock()
            self._record_rates(scheduled, sampled_at - started)
            outputs = self._advance(scheduled, inputs, sampled)
        if inputs.pool_spans:
            outputs += self._pool(inputs, result)
        phases = self.step_phases
        phases.num_steps += 1
        phases.schedule += started - began
        phases.prepare += prepared - started
        phases.forward += forwarded - prepared
        phases.sample += sampled_at - forwarded
        phases.output += clock() - sampled_at
        return outputs

    def _pipelined_step(self) -> list[StepOutput]:
        """Fill the pipeline up to its depth with batches of sequences not already in flight, then
        complete the oldest. Each batch takes about 1/depth of the sequences, so the next batch has
        sequences of its own to keep the first stage busy while later stages run this one."""
        outputs, self._ready = self._ready, []
        while len(self._in_flight) < self.pipeline_depth:
            waiting_or_running = len(self.scheduler.running) + len(self.scheduler.waiting)
            scheduled = self.scheduler.schedule(self._busy, max(1, -(-waiting_or_running // self.pipeline_depth)))
            if not scheduled:
                break
            inputs = prepare_step(scheduled, self.config.block_size, self.device)
            started = time.perf_counter()
            self.executor.submit(inputs)
            self._in_flight.append(_Batch(scheduled, inputs, started))
            self._busy.update(item.seq for item in scheduled)
        if self._in_flight:
            outputs += self._complete_oldest()
        return outputs

    def _complete_oldest(self) -> list[StepOutput]:
        batch = self._in_flight.popleft()
        result = self.executor.collect()
        self._busy.difference_update(item.seq for item in batch.scheduled)
        sampled = self._sample(batch.inputs, result.logits)
        # batches overlap: this one's time is what it added after the previous one completed
        now = time.perf_counter()
        self._record_rates(batch.scheduled, now - max(batch.started, self._last_completed))
        self._last_completed = now
        outputs = self._advance(batch.scheduled, batch.inputs, sampled)
        if batch.inputs.pool_spans:
            outputs += self._pool(batch.inputs, result)
        return outputs

    def _drain_pipeline(self) -> None:
        """Complete every in-flight batch now; their outputs come with the next step()."""
        while self._in_flight:
            self._ready += self._complete_oldest()

    def _sample(self, inputs: StepInputs, logits: torch.Tensor | None) -> list[SampledToken]:
        if not inputs.sample_rows:
            return []
        seqs = [item.seq for item in inputs.sample_seqs]
        return sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                      [s.num_output_tokens for s in seqs], [s.token_ids for s in seqs],
                      [s.num_prompt_tokens for s in seqs], self._allowed_tokens(seqs, logits))

    def _advance(self, scheduled: list[ScheduledSeq], inputs: StepInputs,
                 sampled: list[SampledToken]) -> list[StepOutput]:
        """The step's tokens are computed: sequences move on, full blocks are published, tokens go out."""
        for item in scheduled:
            if item.seq.status is SequenceStatus.FINISHED:  # aborted while in flight: its blocks waited for this
                self.block_manager.free(item.seq)
                continue
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_full_blocks(item.seq)
        return [self._append_token(item.seq, token) for item, token in zip(inputs.sample_seqs, sampled)
                if item.seq.status is not SequenceStatus.FINISHED]

    def _pool(self, inputs: StepInputs, result: ForwardResult) -> list[StepOutput]:
        """Embedding requests of a step whose tokens are computed (after _advance): their pooled rows are
        added to their pooling, and those whose whole prompt is computed finish with their vector."""
        outputs = []
        for span in inputs.pool_spans:
            seq = span.item.seq
            if seq.status is SequenceStatus.FINISHED:   # aborted while in flight
                continue
            seq.pooling.add(span.start, result.pooled[span.rows.start:span.rows.stop] if span.rows else None)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            out = StepOutput(seq.request_id, None, finished=True, finish_reason="stop",
                             num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                             embedding=seq.pooling.vector())
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            self._finish(seq, "stop")
            outputs.append(out)
        return outputs

    def _verify(self, inputs: StepInputs, logits: torch.Tensor) -> list[list[SampledToken]]:
        """The tokens each sampled sequence emits in a step that verified proposals (engine.speculative)."""
        rows = [item.seq for item in inputs.sample_seqs for _ in range(len(item.draft_ids) + 1)]
        return self.speculator.verify(inputs, logits, self._allowed_tokens(rows, logits))

    def _advance_speculative(self, scheduled: list[ScheduledSeq], inputs: StepInputs,
                             emitted: list[list[SampledToken]]) -> list[StepOutput]:
        """As _advance, for a step in which some sequences emit several tokens: before each token is
        appended the K/V of every token before it is computed (the last one's, and the kept proposals'),
        exactly the state a plain step leaves; then blocks that held only rejected proposals are freed."""
        for item in scheduled:
            if not item.draft_ids:
                item.seq.num_computed_tokens += item.num_new_tokens
                self.block_manager.register_full_blocks(item.seq)
        outputs = []
        for item, tokens in zip(inputs.sample_seqs, emitted):
            seq = item.seq
            for token in tokens:
                if item.draft_ids:
                    seq.num_computed_tokens = seq.num_tokens
                    self.block_manager.register_full_blocks(seq)
                out = self._append_token(seq, token)
                outputs.append(out)
                if out.finished:
                    break
            if item.draft_ids and seq.status is not SequenceStatus.FINISHED:
                self.block_manager.shrink(seq, seq.num_computed_tokens)
        return outputs

    def _record_rates(self, scheduled: list[ScheduledSeq], elapsed: float, num_accepted: int = 0) -> None:
        """num_accepted: proposals kept this step, decoded tokens beyond one per decoding sequence."""
        num_prefill = sum(i.num_new_tokens for i in scheduled if i.num_new_tokens > 1)
        num_decoding = len(scheduled) - sum(1 for i in scheduled if i.num_new_tokens > 1)
        num_decode = num_decoding + num_accepted
        self.step_totals.add(num_prefill, num_decode, elapsed)
        if num_prefill:
            # A decode row costs far more than a prompt token (a decode step's fixed cost is most of
            # it), so splitting a step's time by token count would credit its decode rows with a
            # sliver and report a decode rate near the prefill rate. The decode rate comes from steps
            # without prompt tokens; a step with them gives its prompt tokens the time beyond what
            # its decode rows take at that rate (at least a quarter of the step).
            decode_s = num_decode / self.decode_rate.value if num_decode and self.decode_rate.value else 0.0
            self.prefill_rate.update(num_prefill, max(elapsed - decode_s, elapsed / 4))
        elif num_decode and elapsed > 0:
            self.decode_rate.update(num_decode, elapsed)
            self.decode_batch_size.update(num_decoding)
            self.decode_kv_tokens.update(sum(i.seq.num_tokens for i in scheduled if i.num_new_tokens == 1))

    def _allowed_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor | None:
        """The grammar masks of the constrained rows (bool [rows, vocab]); None when no row has a grammar."""
        if self._grammar_compiler is None:
            return None
        bitmask = self._grammar_compiler.fill_masks([s.matcher for s in seqs])
        if bitmask is None:
            return None
        allowed = allowed_from_bitmask(bitmask, logits.shape[-1], logits.device)
        # A matcher in an error state allows nothing; end-of-sequence then ends the row cleanly.
        stuck = ~allowed.any(dim=-1)
        if bool(stuck.any()):
            allowed[stuck.nonzero().flatten(), min(self._grammar_compiler.eos_token_ids)] = True
        return allowed

    def _append_token(self, seq: Sequence, token: SampledToken) -> StepOutput:
        if seq.num_output_tokens == 0 and not seq.prefill_only:
            self.num_prefix_hit_tokens += seq.num_cached_tokens
        seq.token_ids.append(token.token_id)
        out = StepOutput(seq.request_id, token, num_prompt_tokens=seq.num_prompt_tokens,
                         num_cached_tokens=seq.num_cached_tokens)
        if seq.prediction is not None:
            out.num_accepted_prediction_tokens = seq.prediction.num_accepted
            out.num_rejected_prediction_tokens = seq.prediction.num_rejected
        stops = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            stops |= self.eos_token_ids
        if token.token_id in stops:
            out.finish_reason = "stop"
        elif seq.matcher is not None and self._grammar_done(seq, token.token_id):
            out.finish_reason = "stop"
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= seq.max_total_tokens:
            out.finish_reason = "length"
        if seq.prefill_only:
            # finish_reason stays None when decoding should continue elsewhere from this handle
            out.kv_handle = self._pin(seq)
            out.finished = True
            return out
        if out.finish_reason:
            out.finished = True
            self._finish(seq, out.finish_reason)
        return out

    def _grammar_done(self, seq: Sequence, token_id: int) -> bool:
        """Advance the matcher; True once the grammar is complete (only end-of-sequence could follow) or
        the grammar's end token was drawn."""
        if token_id in self._grammar_compiler.eos_token_ids:
            return True
        if not seq.matcher.consume(token_id):
            log.error("request %s: token %d broke its grammar (%s); ending it", seq.request_id, token_id,
                      seq.matcher.matcher.get_error())
            return True
        return seq.matcher.done

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.sequences.pop(seq.request_id, None)

    # -- disaggregation ----------------------------------------------------------------------

    def _pin(self, seq: Sequence) -> str:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.PINNED
        self.sequences.pop(seq.request_id, None)
        handle = secrets.token_hex(16)
        with self._lease_lock:
            self.leases[handle] = Lease(seq, time.monotonic() + self.config.kv_handle_ttl_s)
        return handle

    def release_kv(self, handle: str) -> None:
        with self._lease_lock:
            lease = self.leases.get(handle)
            if lease is None or lease.released:
                raise UnknownHandleError(f"KV handle {handle!r} is unknown, released or expired")
            if lease.num_readers:
                lease.released = True  # freed when the open export closes
                return
            del self.leases[handle]
        self._free_lease(lease)

    def end_lease(self, handle: str) -> None:
        """Safe on any thread: from now on the handle opens no export; release_kv, on the engine's
        thread, still frees its blocks. A single-use lease whose release is queued behind a running
        step must not be read twice in the meantime."""
        with self._lease_lock:
            lease = self.leases.get(handle)
            if lease is not None:
                lease.ended = True

    def _free_lease(self, lease: Lease) -> None:
        self.block_manager.free(lease.seq)
        lease.seq.status = SequenceStatus.FINISHED

    def expire_handles(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lease_lock:
            expired = [handle for handle, lease in self.leases.items()
                       if lease.expires_at <= now and not lease.num_readers and not lease.released]
        for handle in expired:
            log.info("KV handle %s expired unfetched; freeing its blocks", handle[:8])
            self.release_kv(handle)  # a reader that opened it meanwhile keeps it until it closes
        return len(expired)

    def kv_layout(self, num_tokens: int) -> KVLayout:
        mc = self.model_config
        dtype_name = str(self.dtype).removeprefix("torch.")
        return KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype_name, self.config.block_size,
                        num_tokens, self.fingerprint, mc.kv_parts)

    def open_export(self, handle: str) -> KVExport:
        """Hold a leased handle open for reading (see engine.kv_export); close with close_export.

        Safe on any thread: a lease's sequence and block table no longer change."""
        with self._lease_lock:
            lease = self.leases.get(handle)
            if lease is None or lease.released or lease.ended:
                raise UnknownHandleError(f"KV handle {handle!r} is unknown, released or expired")
            lease.num_readers += 1
        seq = lease.seq
        layout = self.kv_layout(seq.num_prompt_tokens)
        bs = self.config.block_size
        tokens_per_chunk = max(bs, (self.config.kv_chunk_bytes // layout.bytes_per_token_per_layer) // bs * bs)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return KVExport(handle, layout, seq.token_ids[: seq.num_prompt_tokens], self.kv_map, table, tokens_per_chunk)

    def close_export(self, export: KVExport) -> None:
        with self._lease_lock:
            lease = self.leases[export.handle]  # a lease with readers is never removed
            lease.num_readers -= 1
            if lease.num_readers or not lease.released:
                return
            del self.leases[export.handle]
        self._free_lease(lease)

    def export_kv(self, handle: str) -> KVPayload:
        """Copy a pinned prompt's K/V out of the pool; the handle stays pinned until released."""
        export = self.open_export(handle)
        try:
            return KVPayload(export.layout, export.token_ids, list(export.chunks()))
        finally:
            self.close_export(export)

    def import_kv(self, request_id: str, payload: KVPayload, params: SamplingParams,
                  generated_ids: list[int]) -> None:
        """Continue a request prefilled elsewhere: write its prompt K/V here and queue it for decode.

        Raises KVTransferError (nothing changed) when the payload is corrupt or does not fit this
        model; when the pool has no room or `max_num_seqs` sequences already run, the request is
        queued to recompute instead (an import never runs past the limit; the agent's admission
        refuses decodes beyond it, so this is the rare race, not the rule).
        """
        if not generated_ids:
            raise InvalidRequestError("import_kv needs the token sampled by the prefill (generated_ids)")
        payload.validate(self.kv_layout(payload.layout.num_tokens))
        seq = self._new_sequence(request_id, payload.token_ids, params, list(generated_ids), prefill_only=False)
        self.sequences[request_id] = seq
        # the watermark is kept for others' growth, as the scheduler keeps it: alone, the import may fill the pool
        reserve = self.scheduler.config.watermark_blocks if self.scheduler.running else 0
        if not self.scheduler.has_free_slot() or not self.block_manager.can_allocate(seq, reserve=reserve):
            log.info("request %s: no room to import KV now; it will recompute its prefill", request_id)
            self.scheduler.add(seq)
            if self.speculator is not None:
                self.speculator.add(seq)
            return
        self.block_manager.allocate(seq)
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.admitted_once = True
        self._write_payload(seq, payload)
        # Cached blocks may reach past the prompt into the generated tokens (a resume whose earlier
        # run here published them): those are computed too, and shared, so never written again.
        seq.num_computed_tokens = max(seq.num_computed_tokens, payload.layout.num_tokens)
        self.block_manager.register_full_blocks(seq)
        self.scheduler.add_running(seq)
        if self.speculator is not None:
            self.speculator.add(seq)

    def _write_payload(self, seq: Sequence, payload: KVPayload) -> None:
        """Each chunk's heads go straight into the pool (of whichever rank) that holds them."""
        mc, bs = self.model_config, self.config.block_size
        already = seq.num_computed_tokens  # prefix-cache hits already hold these tokens' K/V
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        devices = set()
        for chunk in payload.chunks:
            first, count = max(chunk.first_token, already), chunk.first_token + chunk.num_tokens
            if first >= count:
                continue
            with warnings.catch_warnings():  # read-only buffer: we only copy out of it
                warnings.simplefilter("ignore", UserWarning)
                kv = torch.frombuffer(chunk.data, dtype=self.dtype)
            kv = kv.view(mc.kv_parts, chunk.num_tokens, mc.num_kv_heads, mc.head_dim)[:, first - chunk.first_token:]
            positions = torch.arange(first, count)
            slots = table[positions // bs] * bs + positions % bs
            for piece in self.kv_map.write[chunk.layer]:
                device, heads = piece.pool.device, piece.heads
                layer_cache = piece.pool[piece.layer]
                part = kv[:, :, heads.start:heads.stop].to(device)
                on_device = slots.to(device)
                for cache, values in zip(layer_cache, part):   # keys and values, or the latents
                    cache.view(-1, len(heads), mc.head_dim)[on_device] = values
                devices.add(device)
        for device in devices:
            if device.type == "cuda" and device != self.device:
                torch.cuda.synchronize(device)  # another rank's GPU: done before that rank's next step reads it

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [len(prompt_ids), vocab] of every prompt position (scoring; uses free blocks briefly)."""
        seq = self._new_sequence(f"score-{secrets.token_hex(4)}", list(prompt_ids), SamplingParams(max_tokens=1),
                                 [], prefill_only=False)
        self.block_manager.enable_prefix_caching, caching = False, self.block_manager.enable_prefix_caching
        try:
            if not self.block_manager.can_allocate(seq):
                raise InvalidRequestError(f"no room in the KV pool to score {len(prompt_ids)} tokens now")
            self.block_manager.allocate(seq)
            self._drain_pipeline()
            inputs = prepare_step([ScheduledSeq(seq, seq.num_tokens)], self.config.block_size, self.device,
                                  all_rows=True)
            return self.executor.run(inputs).logits
        finally:
            self.block_manager.free(seq)
            self.block_manager.enable_prefix_caching = caching

    # -- state for routers and operators -----------------------------------------------------

    def cache_summary(self, max_hashes: int = 4096) -> dict:
        """Compact prefix-cache summary: block size, the most recently used block hashes (hex), and how many of
        them lead as held by running sequences or KV leases (`num_held`; the rest are evictable)."""
        hashes, num_held = self.block_manager.cache_listing(max_hashes)
        return {"block_size": self.config.block_size, "hashes": [f"{h:016x}" for h in hashes], "num_held": num_held}

    def gpu_indices(self) -> tuple[int, ...]:
        """The GPUs this engine's ranks run on: a parallel engine's where its executor placed them, a single
        rank's its device (a bare "cuda" is cuda:0, the current device of this process); none on a CPU."""
        devices = self.executor.rank_devices if self.layout.world_size > 1 else [self.device]
        return tuple(sorted({d.index or 0 for d in devices if d.type == "cuda"}))

    def stats(self) -> EngineStats:
        running, waiting = self.scheduler.running, self.scheduler.waiting
        gpu_indices = self.gpu_indices()
        return EngineStats(
            num_blocks_total=self.block_manager.num_blocks,
            num_blocks_free=self.block_manager.num_free_blocks,
            block_size=self.config.block_size,
            num_running=len(running),
            num_waiting=len(waiting),
            num_blocks_waiting=self.scheduler.num_blocks_waiting(),
            num_pinned_handles=len(self.leases),
            inflight_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in [*running, *waiting]
                                        if s.num_tokens - s.num_computed_tokens > 1),
            inflight_decode_tokens=sum(s.max_total_tokens - s.num_tokens for s in running),
            prefill_tokens_per_s=self.prefill_rate.value,
            decode_tokens_per_s=self.decode_rate.value,
            decode_batch_size=self.decode_batch_size.value,
            decode_kv_tokens=self.decode_kv_tokens.value,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.num_prefix_hit_tokens,
            steps=self.step_totals.copy(),
            num_kv_blocks_from_compression=self.num_kv_blocks_from_compression,
            num_gpus=len(gpu_indices),
            gpu_indices=gpu_indices,
            tensor_parallel_size=self.layout.tp,
            pipeline_parallel_size=self.layout.pp,
            expert_parallel_size=self.layout.ep,
            **(self._speculation_counts() if self.speculator is not None else {}),
        )

    def _speculation_counts(self) -> dict[str, int]:
        spec = self.speculator
        return {"num_draft_tokens": spec.num_draft_tokens, "num_accepted_draft_tokens": spec.num_accepted_tokens,
                "num_speculative_verifications": spec.num_verifications}
