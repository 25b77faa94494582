"""EAGLE speculative decoding on a DeepSeek-V3-architecture model, with and without spec decoding.

    python examples/eagle_deepseek.py                       # examples/tiny_model (train_tiny.py), CPU ok
    python examples/eagle_deepseek.py --checkpoint DIR      # any HF-format DeepSeek-V3 / V3.2 dir with an MTP layer
    python examples/eagle_deepseek.py --device cuda --backend triton_mla --cuda-graph
    python examples/eagle_deepseek.py --topk 4 --num-draft-tokens 8 --temperature 0.7 --plot spec.png
    torchrun --nproc-per-node 2 examples/eagle_deepseek.py --tp 2   # tensor parallel (gloo on CPU, NCCL on GPUs)

The prompts are the beginnings of held-out standard-library files (train_tiny.py's split), as
bytes. Prints the continuations, the mean accept length, decode tokens/s both ways and the
speedup, and (greedy) how many requests got exactly the target's own greedy output (all of them in
fp32), with the target's fp32 logit gap at the first difference of any that did not. Without
examples/tiny_model/ (train it with examples/train_tiny.py) a randomly initialised tiny model runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import re
import sys
import time
from dataclasses import dataclass

import torch
from safetensors import SafetensorError

from attn.base import KV_DTYPES
from attn.registry import backend_names
from specdec.baseline import GreedyDecoder, sequence_logits
from specdec.config import SpecConfig
from specdec.kv import check_memory
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.models import load_deepseek, load_mtp
from specdec.parallel import Parallel, launch_problem, start_ranks
from specdec.sampling import SamplingParams
from specdec.worker import EagleWorker
from train_tiny import DEFAULT_OUT, stdlib_files


def tiny_default(device: torch.device, dtype: torch.dtype) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """A small randomly initialised model with DeepSeek-V3's MLA dims (latent 512, rope 64)."""
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=16, q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, max_position_embeddings=2048,
    )
    target = DeepseekV3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    mtp = DeepseekMTP(cfg, target=target).to(device=device, dtype=dtype).eval()
    return target, mtp


def load_models(checkpoint: str | None, device: torch.device, dtype: torch.dtype,
                parallel: Parallel) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """The checkpoint's target and MTP draft (this rank's slice); default examples/tiny_model, else
    the random tiny model (one process only)."""
    path = checkpoint or (DEFAULT_OUT if (DEFAULT_OUT / "config.json").exists() else None)
    if path is None and parallel.size > 1:
        raise FileNotFoundError(f"no checkpoint: --tp needs one (train {DEFAULT_OUT} with examples/train_tiny.py)")
    if path is None:
        print(f"{DEFAULT_OUT} not found: train it with `python examples/train_tiny.py` (one GPU, a few minutes); "
              "running a randomly initialised tiny model instead (expect short accept lengths)")
        return tiny_default(device, dtype)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError("not an HF-format checkpoint directory (no config.json in it)")
    print(f"model: {path}")
    target = load_deepseek(str(path), dtype, device, parallel)
    return target, load_mtp(str(path), dtype, device, target=target)


def stdlib_prompts(n: int, max_len: int) -> list[tuple[str, list[int]]]:
    """(file name, bytes) of n held-out stdlib files: each file's first max_len bytes, cut after
    their last newline (files reused in turn if n exceeds them: one list per file, shared)."""
    files = stdlib_files(heldout=True)[:n]
    heads = [f.read_bytes()[:max_len] for f in files]
    heads = [list(head[: head.rfind(b"\n") + 1] or head) for head in heads]
    return [(files[i % len(files)].name, heads[i % len(files)]) for i in range(n)]


# The SpecConfig fields (and SamplingParams') this example sets, as the flags that set them: a
# refusal of the library names the field; the user typed the flag.
FLAGS = {
    "attention_backend": "--backend", "decode_backend": "--backend", "prefill_backend": "--backend",
    "num_steps": "--num-steps", "topk": "--topk", "num_draft_tokens": "--num-draft-tokens",
    "kv_dtype": "--kv-dtype", "page_size": "--page-size", "max_batch_size": "--batch-size",
    "num_pages": "the KV pages (--batch-size full contexts)",
    "max_context_len": "the context length (--prompt-len + --max-new-tokens)", "max_new_tokens": "--max-new-tokens",
    "enable_sampling": "--temperature", "temperature": "--temperature",
}


def as_flags(message: str) -> str:
    """message with each setting of FLAGS named by its flag, ``name=value`` as ``flag value``:
    "set attention_backend to one of [...]" -> "set --backend to one of [...]",
    "use topk=1" -> "use --topk 1", "kv_dtype='auto' is" -> "--kv-dtype auto is"."""
    pattern = rf"\b({'|'.join(FLAGS)})\b(?:=('?)([\w.+-]+)\2)?"
    return re.sub(pattern, lambda m: FLAGS[m[1]] + (f" {m[3]}" if m[3] else ""), message)


def context_len(longest_prompt: int, max_new_tokens: int, cfg: SpecConfig) -> int:
    """Block-table width for these requests: prompt, new tokens and the tree's headroom, rounded up
    to whole pages and 128-token blocks (every backend's table width: cutedsl_mla's needs them)."""
    step = math.lcm(128, cfg.page_size)
    return step * -(-(longest_prompt + max_new_tokens + cfg.spec_headroom) // step)


def spec_config(args: argparse.Namespace, backend: str, page_size: int, batch: int, longest_prompt: int) -> SpecConfig:
    """The SpecConfig the flags ask for, sized for ``batch`` requests of prompts up to
    ``longest_prompt`` tokens and --max-new-tokens each. Raises ConfigError naming the setting."""
    cfg = SpecConfig(  # first one request of any context, for the tree's headroom
        num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, attention_backend=backend,
        kv_dtype=args.kv_dtype, page_size=page_size, max_batch_size=1,
        max_context_len=math.lcm(128, page_size) << 13, enable_sampling=args.temperature > 0,
    )
    return dataclasses.replace(cfg, max_batch_size=batch,
                               max_context_len=context_len(longest_prompt, args.max_new_tokens, cfg))


@dataclass
class Measurement:
    """One batch decoded both ways: outputs, target-only greedy outputs, per-step accept lengths,
    and decode-phase tokens/s (prefill and graph capture excluded) of each."""

    outputs: list[list[int]]
    baseline: list[list[int]]
    accept: list[int]
    emitted: int  # tokens the spec steps emitted (a request's last step emits only up to max_new_tokens)
    base_tok_s: float
    spec_tok_s: float


def build_worker(target: DeepseekV3ForCausalLM, draft: DeepseekMTP, prompts: list[list[int]],
                 args: argparse.Namespace, backend: str, page_size: int) -> EagleWorker:
    """The worker for this batch (its config from the flags), with its CUDA graphs under
    --cuda-graph. Raises ValueError naming the setting (ConfigError: the config's and the worker's
    refusals, the KV caches' memory among them)."""
    cfg = spec_config(args, backend, page_size, len(prompts), max(map(len, prompts)))
    param = next(target.parameters())
    # (layers, indexer key width) of the worker's two pools and target-only decoding's
    target_pool = (target.num_attention_layers, target.attn_spec().index_head_dim)
    pools = (target_pool, (draft.num_attention_layers, draft.attn_spec().index_head_dim), target_pool)
    check_memory(cfg, pools, cfg.cache_dtype(param.dtype, param.device), param.device)
    with torch.inference_mode():  # (the worker's tensors, as measure's decoding, are inference tensors)
        worker = EagleWorker(target, draft, cfg)
        if args.cuda_graph:
            worker.capture_graphs()
    return worker


def measure(worker: EagleWorker, target: DeepseekV3ForCausalLM, prompts: list[list[int]], args: argparse.Namespace,
            device: torch.device) -> Measurement:
    """Decode prompts target-only (greedy) and with spec decoding, each after a warm-up and then
    ``args.repeats`` times (tokens/s of the fastest run); both with CUDA graphs when asked (the
    baseline captures one decode step)."""
    cfg = worker.config
    sampling = [SamplingParams(temperature=args.temperature, seed=i) for i in range(len(prompts))]
    graphs = {"backend": cfg.attention_backend, "page_size": cfg.page_size, "cuda_graph": args.cuda_graph,
              "kv_dtype": KV_DTYPES.get(args.kv_dtype)}

    def target_only() -> tuple[list[list[int]], float]:
        """Prefill, the first (eager) and second (capturing) decode steps untimed, then the rest:
        outputs and the seconds of the max_new_tokens - 3 timed steps."""
        decoder = GreedyDecoder(target, prompts, args.max_new_tokens, **graphs)
        for _ in range(2):
            decoder.step()
        _sync(device)
        start = time.perf_counter()
        for _ in range(args.max_new_tokens - 3):
            decoder.step()
        _sync(device)
        return decoder.outputs(), time.perf_counter() - start

    def spec(max_new: int) -> tuple[list, list[int], int, float]:
        """Prefill (not timed), then spec steps until every request is done: requests, accept
        lengths, tokens emitted and seconds."""
        reqs = worker.add_requests(prompts, max_new, sampling=sampling)  # prefill: the first token
        _sync(device)
        start = time.perf_counter()
        accept: list[int] = []
        emitted = 0
        while worker.requests:
            stats = worker.step()
            accept += stats.accept_lens
            emitted += stats.num_emitted
        _sync(device)
        return reqs, accept, emitted, time.perf_counter() - start

    with torch.inference_mode():
        # Warm-up (JIT, allocator; the kernels specialise on the context length), then the two
        # ways alternate, so drifting clocks hit both alike; the fastest of --repeats runs counts.
        target_only(), spec(min(cfg.num_steps + 2, args.max_new_tokens))  # (the context fits max_new_tokens)
        base_s, spec_s = float("inf"), float("inf")
        for _ in range(args.repeats):
            baseline, seconds = target_only()
            base_s = min(base_s, seconds)
            reqs, accept, emitted, seconds = spec(args.max_new_tokens)
            spec_s = min(spec_s, seconds)
        base_tok_s = len(prompts) * (args.max_new_tokens - 3) / base_s
        spec_tok_s = sum(len(r.output) - 1 for r in reqs) / spec_s
    return Measurement([r.output for r in reqs], baseline, accept, emitted, base_tok_s, spec_tok_s)


def divergences(target: DeepseekV3ForCausalLM, prompts: list[list[int]], run: Measurement) -> list[str]:
    """For each request whose spec output differs from target-only greedy: the first differing
    position and the target's fp32 logit gap there between the two tokens (CPU, torch_ref). A gap
    near zero is a near-tie that reduced-precision kernels may break either way."""
    fp32 = copy.deepcopy(target).float().cpu()
    lines = []
    for i, (prompt, out, base) in enumerate(zip(prompts, run.outputs, run.baseline)):
        p = next((k for k, (a, b) in enumerate(zip(out, base)) if a != b), None)
        if p is not None:
            logits = sequence_logits(fp32, prompt + base[:p])[-1]
            top2 = logits.topk(2).values
            lines.append(f"request {i}: first difference at output token {p}: fp32 logit gap {(logits[base[p]] - logits[out[p]]).item():.4f} "
                         f"(target-only token minus spec token; fp32 top-2 gap {(top2[0] - top2[1]).item():.4f})")
    return lines


def show(tokens: list[int], vocab_size: int) -> str:
    """Bytes as text for a byte-level vocabulary, else the token ids."""
    return bytes(tokens).decode(errors="replace") if vocab_size == 256 else str(tokens)


def plot(path: str, main: Measurement, sweep: dict[int, Measurement], title: str) -> None:
    """PNG: the accept-length histogram of the main run, and tokens/s by batch size both ways."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.hist(main.accept, bins=range(max(main.accept) + 2), align="left", rwidth=0.8)
    ax1.set(xlabel="accepted draft tokens per step", ylabel="steps", title="accept length")
    ax1.set_xticks(range(max(main.accept) + 1))
    sizes = sorted(sweep)
    ax2.plot(sizes, [sweep[b].base_tok_s for b in sizes], "o-", label="target only")
    ax2.plot(sizes, [sweep[b].spec_tok_s for b in sizes], "o-", label="spec decoding")
    ax2.set(xscale="log", xlabel="batch size", ylabel="tokens/s", title="throughput")
    ax2.set_xticks(sizes, [str(b) for b in sizes])
    ax2.minorticks_off()
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", metavar="DIR",
                    help=f"HF-format DeepSeek-V3 or V3.2 directory with an MTP layer (default: {DEFAULT_OUT})")
    ap.add_argument("--backend", default=None, choices=backend_names(), metavar="NAME",
                    help=f"attention backend, one of {', '.join(backend_names())} "
                         "(default: torch_ref on CPU, triton_mla on CUDA)")
    ap.add_argument("--num-steps", type=int, default=3, metavar="N",
                    help="draft forwards per step, the tree's depth (default %(default)s)")
    ap.add_argument("--topk", type=int, default=1, metavar="K",
                    help="branches kept per draft step (default %(default)s: a chain; > 1: a tree, needs "
                         "--num-draft-tokens)")
    ap.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                    help="tree nodes verified per request, the root included (default with --topk 1: --num-steps + 1)")
    ap.add_argument("--batch-size", type=int, default=2, metavar="B",
                    help="requests decoded together (default %(default)s; held-out stdlib files, reused past "
                         "their number)")
    ap.add_argument("--prompt-len", type=int, default=160, metavar="BYTES",
                    help="prompt bytes per file, at most, cut at a newline (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                    help="tokens to generate per request (default %(default)s), at least 4: target-only timing "
                         "skips three")
    ap.add_argument("--temperature", type=float, default=0.0, metavar="T",
                    help="0 (default): greedy; > 0: rejection-sampling verification (the speedup is then against "
                         "greedy target-only decoding)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", *KV_DTYPES],
                    help="KV cache dtype (auto: the model's; tokenspeed_mla needs fp8_e4m3)")
    ap.add_argument("--page-size", type=int, default=None, metavar="TOKENS",
                    help="tokens per KV page (default 64, which every backend takes; the Blackwell ones take 32 or 64)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the spec step (and target-only decoding) as CUDA graphs: one launch a step; "
                         "CUDA only")
    ap.add_argument("--repeats", type=int, default=3, metavar="N",
                    help="timed runs each way; the fastest counts (default %(default)s)")
    ap.add_argument("--plot", metavar="PATH", help="also time batch sizes 1, 2, 4, .. up to --batch-size; write a PNG")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda where there is one; with --tp, each rank's cuda:LOCAL_RANK)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel ranks, under torchrun --nproc-per-node N (gloo on CPU, NCCL on GPUs); rank 0 prints")
    return ap


def start_parallel(ap: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> tuple[Parallel, torch.device]:
    """This process's rank (one process without --tp) and its device; other ranks print nothing."""
    problem = launch_problem(args.tp, device)
    if problem:
        ap.error(f"--tp {args.tp}: {problem}")
    parallel, device = start_ranks(args.tp, device)
    if parallel.rank:
        sys.stdout = open(os.devnull, "w")
    return parallel, device


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Refuse flag values the library would not name as flags (parser.error: exit 2); the device."""
    if args.max_new_tokens < 4:
        ap.error("--max-new-tokens must be at least 4: the target-only timing leaves out the first three tokens")
    for flag in ("batch_size", "prompt_len", "repeats", "page_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.topk == 1 and args.num_draft_tokens not in (None, args.num_steps + 1):
        ap.error(f"with --topk 1 the tree is a chain of --num-steps + 1 = {args.num_steps + 1} tokens: leave "
                 f"--num-draft-tokens out or set it to that, got {args.num_draft_tokens}")
    try:
        SamplingParams(temperature=args.temperature)
    except ValueError as err:
        ap.error(as_flags(str(err)))
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch has no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        ap.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if args.cuda_graph and device.type != "cuda":
        ap.error("--cuda-graph needs --device cuda")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked now, not after the sweep)
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            ap.error(f"--plot {args.plot}: no such directory")
    return device


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    device = check_args(ap, args)
    parallel, device = start_parallel(ap, args, device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    backend = args.backend or ("torch_ref" if device.type == "cpu" else "triton_mla")
    # Every backend takes 64-token pages: only a page size the user chose can draw the registry's
    # warning (a Blackwell backend given another one uses 64).
    page_size = args.page_size or 64
    try:  # the flags' settings, checked before the model loads (the context once the prompts are known)
        spec_config(args, backend, page_size, args.batch_size, 1)
    except ValueError as err:  # ConfigError (a ValueError) names the setting; the user typed the flag
        ap.error(as_flags(str(err)))
    try:
        target, draft = load_models(args.checkpoint, device, dtype, parallel)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as err:
        ap.error(f"--checkpoint {args.checkpoint or DEFAULT_OUT}: {err}")
    if parallel.size == 1:  # eh_proj's embedding half as a per-token table: each draft pass reads half of eh_proj
        draft.cache_token_projection()
    vocab = target.config.vocab_size
    if vocab < 256:
        ap.error(f"--checkpoint {args.checkpoint}: its vocabulary of {vocab} tokens cannot take the byte prompts")

    def out_of_memory(err: RuntimeError, batch: int) -> None:
        """parser.error for torch.OutOfMemoryError or the CPU allocator's "can't allocate"; else re-raise."""
        if not (isinstance(err, torch.OutOfMemoryError) or "allocate" in str(err)):
            raise err
        ap.error(f"--batch-size {batch}: out of memory on {device} ({str(err).splitlines()[0][:200]}); "
                 "lower --batch-size (or --prompt-len, --max-new-tokens)")

    def run(prompts: list[list[int]]) -> tuple[Measurement, SpecConfig]:
        """measure() with a worker built for these prompts, and the worker's config."""
        try:
            worker = build_worker(target, draft, prompts, args, backend, page_size)
        except ValueError as err:  # ConfigError (a ValueError) names the setting; the user typed the flag
            ap.error(as_flags(str(err)))
        except RuntimeError as err:
            out_of_memory(err, len(prompts))
        try:
            return measure(worker, target, prompts, args, device), worker.config
        except RuntimeError as err:
            out_of_memory(err, len(prompts))

    named = stdlib_prompts(args.batch_size, args.prompt_len)
    prompts = [p for _, p in named]
    result, cfg = run(prompts)

    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    for (name, prompt), out in zip(named, result.outputs):
        if bold:
            print(f"----- {name} (continuation in bold)\n{show(prompt, vocab)}{bold}{show(out, vocab)}{plain}")
        else:
            print(f"----- {name}\n{show(prompt, vocab)}\n----- continuation\n{show(out, vocab)}")
    print("-----")
    mean_accept = sum(result.accept) / max(len(result.accept), 1)
    print(f"backend {backend}, num_steps {cfg.num_steps}, topk {cfg.topk}, num_draft_tokens {cfg.num_draft_tokens}, "
          f"temperature {args.temperature}, batch {len(prompts)}, device {device}{', CUDA graphs' if args.cuda_graph else ''}"
          f"{f', tensor parallel over {parallel.size} ranks' if parallel.size > 1 else ''}")
    print(f"mean accept length: {mean_accept:.2f} drafted tokens/step "
          f"({result.emitted / max(len(result.accept), 1):.2f} tokens/step emitted)")
    print(f"decode tokens/s: target-only {result.base_tok_s:.1f}, spec {result.spec_tok_s:.1f}, "
          f"speedup {result.spec_tok_s / result.base_tok_s:.2f}x")
    if args.temperature == 0:
        same = sum(a == b for a, b in zip(result.outputs, result.baseline))
        print(f"lossless (spec == target-only greedy): {same}/{len(prompts)} requests identical")
        for line in divergences(target, prompts, result):
            print("  " + line)
    if args.plot:
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < args.batch_size]
        sweep = {b: run(prompts[:b])[0] for b in sizes} | {args.batch_size: result}
        plot(args.plot, result, sweep, f"{backend}, num_steps {cfg.num_steps}, topk {cfg.topk}, "
                                       f"num_draft_tokens {cfg.num_draft_tokens}, temperature {args.temperature}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
