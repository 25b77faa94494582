"""EAGLE speculative decoding on a DeepSeek-V3-architecture model, with and without spec decoding.

    python examples/eagle_deepseek.py                       # examples/tiny_model (train_tiny.py), CPU ok
    python examples/eagle_deepseek.py --checkpoint DIR      # any HF-format DeepSeek-V3 dir with an MTP layer
    python examples/eagle_deepseek.py --device cuda --backend triton_mla --cuda-graph
    python examples/eagle_deepseek.py --topk 4 --num-draft-tokens 8 --temperature 0.7 --plot spec.png

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
import sys
import time
from dataclasses import dataclass

import torch

from specdec.baseline import GreedyDecoder, sequence_logits
from attn.base import KV_DTYPES
from specdec.config import ConfigError, SpecConfig
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.models import load_deepseek, load_mtp
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


def load_models(checkpoint: str | None, device: torch.device, dtype: torch.dtype) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """The checkpoint's target and MTP draft; default examples/tiny_model, else the random tiny model."""
    path = checkpoint or (DEFAULT_OUT if (DEFAULT_OUT / "config.json").exists() else None)
    if path is None:
        print(f"{DEFAULT_OUT} not found: train it with `python examples/train_tiny.py` (one GPU, a few minutes); "
              "running a randomly initialised tiny model instead (expect short accept lengths)")
        return tiny_default(device, dtype)
    print(f"model: {path}")
    target = load_deepseek(str(path), dtype, device)
    return target, load_mtp(str(path), dtype, device, target=target)


def stdlib_prompts(n: int, max_len: int) -> list[tuple[str, list[int]]]:
    """(file name, bytes) of n held-out stdlib files: each file's first max_len bytes, cut after
    their last newline (files reused in turn if n exceeds them)."""
    files = stdlib_files(heldout=True)
    out = []
    for i in range(n):
        head = files[i % len(files)].read_bytes()[:max_len]
        out.append((files[i % len(files)].name, list(head[: head.rfind(b"\n") + 1] or head)))
    return out


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


def measure(target: DeepseekV3ForCausalLM, draft: DeepseekMTP, prompts: list[list[int]], args: argparse.Namespace,
            device: torch.device, backend: str) -> tuple[Measurement, SpecConfig]:
    """Decode prompts target-only (greedy) and with spec decoding, each after a warm-up and then
    ``args.repeats`` times (tokens/s of the fastest run); both with CUDA graphs when asked (the
    baseline captures one decode step)."""
    # A provisional config for its spec_headroom: one request of a context that fits any prompt.
    cfg = SpecConfig(
        num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, attention_backend=backend,
        kv_dtype=args.kv_dtype, page_size=64 if device.type == "cuda" else 16, max_batch_size=1,
        max_context_len=1 << 20, enable_sampling=args.temperature > 0,
    )
    # The longest prompt, its new tokens and the spec step's headroom, in whole 128-token blocks:
    # every backend's table width (cutedsl_mla's needs them).
    context = 128 * ((max(map(len, prompts)) + args.max_new_tokens + cfg.spec_headroom + 127) // 128)
    cfg = dataclasses.replace(cfg, max_batch_size=len(prompts), max_context_len=context)
    sampling = [SamplingParams(temperature=args.temperature, seed=i) for i in range(len(prompts))]
    graphs = {"backend": backend, "page_size": cfg.page_size, "cuda_graph": args.cuda_graph,
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
        worker = EagleWorker(target, draft, cfg)
        if args.cuda_graph:
            from graphs.runner import GraphRunner

            GraphRunner(worker)
        # Warm-up (JIT, allocator; the kernels specialise on the context length), then the two
        # ways alternate, so drifting clocks hit both alike; the fastest of --repeats runs counts.
        target_only(), spec(cfg.num_steps + 2)
        base_s, spec_s = float("inf"), float("inf")
        for _ in range(args.repeats):
            baseline, seconds = target_only()
            base_s = min(base_s, seconds)
            reqs, accept, emitted, seconds = spec(args.max_new_tokens)
            spec_s = min(spec_s, seconds)
        base_tok_s = len(prompts) * (args.max_new_tokens - 3) / base_s
        spec_tok_s = sum(len(r.output) - 1 for r in reqs) / spec_s
    return Measurement([r.output for r in reqs], baseline, accept, emitted, base_tok_s, spec_tok_s), cfg


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help=f"HF-format DeepSeek-V3 directory with an MTP layer (default: {DEFAULT_OUT})")
    ap.add_argument("--backend", default=None, help="attention backend (default: torch_ref on CPU, triton_mla on CUDA)")
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=160, help="prompt bytes per file, at most (cut at a newline)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="at least 4: target-only timing skips three")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: rejection-sampling verification "
                    "(the speedup is then against greedy target-only decoding)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", *KV_DTYPES],
                    help="KV cache dtype (auto: the model's; tokenspeed_mla needs fp8_e4m3)")
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs each way; the fastest counts")
    ap.add_argument("--plot", metavar="PATH", help="also time batch sizes 1, 2, 4, .. up to --batch-size; write a PNG")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.max_new_tokens < 4:
        ap.error("--max-new-tokens must be at least 4: the target-only timing leaves out the first three tokens")
    for flag in ("batch_size", "prompt_len", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.cuda_graph and not args.device.startswith("cuda"):
        ap.error("--cuda-graph needs --device cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch has no CUDA device")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked now, not after the sweep)
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    backend = args.backend or ("torch_ref" if device.type == "cpu" else "triton_mla")
    target, draft = load_models(args.checkpoint, device, dtype)
    vocab = target.config.vocab_size
    named = stdlib_prompts(args.batch_size, args.prompt_len)
    prompts = [p for _, p in named]
    try:
        run, cfg = measure(target, draft, prompts, args, device, backend)
    except ConfigError as err:  # settings the worker refuses (it names the one to change)
        ap.error(str(err))

    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    for (name, prompt), out in zip(named, run.outputs):
        if bold:
            print(f"----- {name} (continuation in bold)\n{show(prompt, vocab)}{bold}{show(out, vocab)}{plain}")
        else:
            print(f"----- {name}\n{show(prompt, vocab)}\n----- continuation\n{show(out, vocab)}")
    print("-----")
    mean_accept = sum(run.accept) / max(len(run.accept), 1)
    print(f"backend {backend}, num_steps {cfg.num_steps}, topk {cfg.topk}, num_draft_tokens {cfg.num_draft_tokens}, "
          f"temperature {args.temperature}, batch {len(prompts)}, device {device}{', CUDA graphs' if args.cuda_graph else ''}")
    print(f"mean accept length: {mean_accept:.2f} drafted tokens/step "
          f"({run.emitted / max(len(run.accept), 1):.2f} tokens/step emitted)")
    print(f"decode tokens/s: target-only {run.base_tok_s:.1f}, spec {run.spec_tok_s:.1f}, "
          f"speedup {run.spec_tok_s / run.base_tok_s:.2f}x")
    if args.temperature == 0:
        same = sum(a == b for a, b in zip(run.outputs, run.baseline))
        print(f"lossless (spec == target-only greedy): {same}/{len(prompts)} requests identical")
        for line in divergences(target, prompts, run):
            print("  " + line)
    if args.plot:
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < args.batch_size]
        sweep = {b: measure(target, draft, prompts[:b], args, device, backend)[0] for b in sizes} | {args.batch_size: run}
        plot(args.plot, run, sweep, f"{backend}, num_steps {cfg.num_steps}, topk {cfg.topk}, "
                                    f"num_draft_tokens {cfg.num_draft_tokens}, temperature {args.temperature}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
