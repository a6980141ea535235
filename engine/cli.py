"""Engine commands: `generate` (one-shot generation from a checkpoint), `make-demo-model` and `compress`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

from engine.compression import WEIGHT_MODES
from engine.demo import ARCHITECTURES, SIZES

DEFAULT_DEMO_DIR = Path(".edgefire/demo-model")


def add_parser(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate text from a local checkpoint")
    gen.add_argument("--model", required=True, help="checkpoint directory (Hugging Face format)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="the most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 (default) picks the most likely token")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the likeliest tokens "
                     "whose probabilities sum to P (default 1: all)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens (default 0: all)")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling, for repeatable output")
    gen.add_argument("--device", default="auto", help="auto (default: a GPU when torch sees one, else the CPU), "
                     "cpu, cuda or cuda:N")
    gen.add_argument("--dtype", default="auto", help="auto (default: bfloat16 on a GPU, float32 on the CPU), "
                     "bfloat16, float16 or float32")
    gen.add_argument("--weight-mode", default="decompress_on_load", choices=WEIGHT_MODES,
                     help="for a compressed checkpoint: decode every weight at load (default), or keep the MLP "
                          "weights compressed and decode them layer by layer (more KV cache)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="split each layer's heads and MLP across N ranks (one process and device each)")
    gen.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="M",
                     help="split the layers into M pipeline stages")
    gen.add_argument("--expert-parallel-size", type=int, default=1, metavar="E",
                     help="split each mixture-of-experts layer's experts across E ranks per stage (E equal to "
                          "--tensor-parallel-size, or with tensor parallelism 1: attention repeated on each)")
    gen.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                     help="speculative decoding: n-gram prompt lookup, or a draft model (--draft-model)")
    gen.add_argument("--speculative-tokens", type=int, default=3, metavar="K",
                     help="the most tokens proposed per step (default 3)")
    gen.add_argument("--draft-model", default=None, metavar="DIR",
                     help="the draft checkpoint (same tokenizer) for --speculative draft")
    gen.set_defaults(func=run_generate)

    comp = subparsers.add_parser("compress", help="write a losslessly compressed copy of a bf16 checkpoint")
    comp.add_argument("source", type=Path, help="checkpoint directory (Hugging Face format)")
    comp.add_argument("destination", type=Path, help="new directory for the compressed checkpoint")
    comp.add_argument("--tensors", default="mlp", choices=["mlp", "all"],
                      help="compress the MLP weights only (default) or every floating-point tensor")
    comp.add_argument("--chunk-size", type=int, default=None,
                      help="elements per independently decodable chunk (a power of two, 64 to 262144); "
                           "default: 1024, smaller for small tensors")
    comp.add_argument("--force", action="store_true", help="replace the destination if it exists")
    comp.set_defaults(func=run_compress)

    demo = subparsers.add_parser("make-demo-model", help="write a small random-weight demo checkpoint")
    demo.add_argument("directory", type=Path, help="new directory for the checkpoint")
    demo.add_argument("--size", default="small", choices=list(SIZES),
                      help="tiny (tests), small (default: make run and demos) or medium (benchmarks)")
    demo.add_argument("--arch", default="llama", choices=list(ARCHITECTURES),
                      help="llama (dense), or a mixture of experts with top-2 routing: mixtral, qwen3-moe, or "
                           "deepseek-v3 (grouped routing, a shared expert, multi-head latent attention)")
    demo.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    demo.set_defaults(func=run_make_demo_model)


def run_make_demo_model(args: argparse.Namespace) -> int:
    from engine.demo import make_demo_model

    if (args.directory / "config.json").exists() and not args.force:
        print(f"{args.directory} already holds a checkpoint; use --force to overwrite", file=sys.stderr)
        return 0
    make_demo_model(args.directory, args.size, arch=args.arch)
    print(f"wrote a random-weight {args.arch} demo model to {args.directory} (its output is meaningless text)")
    return 0


def run_compress(args: argparse.Namespace) -> int:
    from engine.compression.compress import compress_checkpoint
    from engine.errors import EngineError

    # A kill (timeout, systemd, a scheduler) unwinds like Ctrl-C, so the half-written copy is removed.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        report = compress_checkpoint(args.source, args.destination, args.tensors, args.chunk_size, args.force)
    except (EngineError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(report.table())
    total = report.total
    weights = "bf16 weights and MXFP4 experts" if report.mxfp4_tensors else "bf16 weights"
    print(f"wrote {args.destination} in {report.seconds:.1f} s: {total.num_compressed} of {total.num_tensors} tensors "
          f"compressed, every tensor verified bit-exact; {total.bf16_bytes / 2**20:.1f} MiB of {weights} stored "
          f"in {total.stored_bytes / 2**20:.1f} MiB ({total.saving:.1%} smaller)")
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def check_utf8(text: str, flag: str) -> None:
    """ValueError naming `flag` and the first offending byte when `text` came from bytes that are not
    UTF-8 (Python keeps such argv bytes as lone surrogates, which the tokenizer refuses with a traceback)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        offset = len(text[:exc.start].encode("utf-8", "surrogateescape"))
        byte = text[exc.start].encode("utf-8", "surrogateescape")[:1]
        raise ValueError(f"{flag}: not UTF-8 text (byte 0x{byte.hex()} at byte {offset}); give it in UTF-8 "
                         f"(convert it with e.g. `iconv -f latin1 -t utf-8`)") from None


def run_generate(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncEngine
    from engine.engine import EngineConfig, LLMEngine
    from engine.errors import EngineError
    from engine.sampling import SamplingParams
    from engine.speculative_config import SpeculativeConfig
    from engine.tokenizer import ChatTokenizer, IncrementalDetokenizer

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        check_utf8(args.prompt, "--prompt")
        tokenizer = ChatTokenizer.from_dir(args.model)
        params.validate(tokenizer.vocab_size)
        if args.chat:
            prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt_ids = tokenizer.encode(args.prompt)
        speculative = (SpeculativeConfig(args.speculative, args.speculative_tokens, draft_model=args.draft_model)
                       if args.speculative else None)
        engine = AsyncEngine(LLMEngine(args.model, EngineConfig(
            device=args.device, dtype=args.dtype, weight_mode=args.weight_mode,
            tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
            expert_parallel_size=args.expert_parallel_size,
            speculative=speculative)))
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def stream() -> None:
        detok = IncrementalDetokenizer(tokenizer)
        started, first_at, count, reason = time.perf_counter(), None, 0, None
        async for event in engine.generate(prompt_ids, params):
            first_at = first_at or time.perf_counter()
            count += 1
            reason = event.finish_reason
            sys.stdout.write(detok.add([event.token_id]))
            sys.stdout.flush()
        sys.stdout.write(detok.flush())   # a character the last tokens left incomplete
        elapsed = time.perf_counter() - started
        ttft = (first_at - started) * 1000 if first_at else float("nan")
        print(f"\n[{len(prompt_ids)} prompt tokens, {count} generated, finish={reason}, "
              f"ttft {ttft:.0f} ms, {count / elapsed:.1f} tok/s]", file=sys.stderr)

    try:
        asyncio.run(stream())
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    return 0
