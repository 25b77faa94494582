"""Train a tiny byte-level DeepSeek-V3-architecture model and its MTP (EAGLE) draft layer.

    python examples/train_tiny.py                          # minutes on a GPU (docs/benchmarks.md)
    python examples/train_tiny.py --target-steps 20 --mtp-steps 10 --batch-size 4 --target-seconds 30 --mtp-seconds 15 --out /tmp/tiny  # smoke run

Data: the standard library's own ``*.py`` files as bytes (vocabulary 256); one file in 20 is held
out for evaluation by a hash of its path below the stdlib root, the same rule on every Python.

Target: next-byte cross-entropy. Draft (``DeepseekMTP``, sharing the frozen target's embedding
and head): position p gets byte t_{p+1} and the target's final hidden state h_p and learns the
target's distribution at p + 1 (over t_{p+2}), while its output hidden state regresses onto
h_{p+1} as in EAGLE, since later draft steps are fed that state in place of the target's. A
second, unrolled pass trains exactly that: position p + 1 gets t_{p+2} and the draft's own output
o_p and learns the target's distribution at p + 2.

``--init-from DIR`` keeps DIR's target and continues training its draft layer, whose
checkpoint copies of the embedding and head then train with it (the shipped model was made so:
the default run, then ``--init-from`` with ``--mtp-seconds 170 --lr 1e-3``).

Writes config.json + model.safetensors (bf16, MTP layer included) to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
import zlib
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from attn.base import KV_LORA_RANK
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM, load_deepseek, load_mtp, save_deepseek

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}  # not code, or generated
DEFAULT_OUT = Path(__file__).resolve().parent / "tiny_model"


def stdlib_files(heldout: bool) -> list[Path]:
    """The stdlib's ``*.py`` source files (sorted), training split or held-out split (1 in 20)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not SKIP_DIRS & set(rel.parts[:-1]) and (zlib.crc32(rel.as_posix().encode()) % 20 == 0) == heldout:
            files.append(path)
    return files


def load_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes, concatenated: ``[N]`` uint8."""
    return torch.frombuffer(bytearray(b"".join(p.read_bytes() for p in files)), dtype=torch.uint8)


def tiny_config() -> DeepseekV3Config:
    """DeepSeek-V3's MLA dims (latent 512, rope 64, 16 heads), 8 dense layers of width 256, byte vocabulary.

    Eight layers against the one-layer draft, as a real target's depth dwarfs its MTP layer's (61 to 1):
    at three, the draft steps cost about what the verify saves. Narrow heads (nope and v 32) keep
    the checkpoint about 25 MB."""
    return DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=16,
        q_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=0, max_position_embeddings=2048,
    )


class DenseCausalAttention:
    """Training-time attention backend: no KV cache; ``batch`` is the number of equal-length
    sequences packed into the T tokens, each attending causally to itself (block-diagonal causal)."""

    def __init__(self, sm_scale: float) -> None:
        self.sm_scale = sm_scale

    def forward(self, q: torch.Tensor, kv_new: torch.Tensor, layer_id: int, batch: int) -> torch.Tensor:
        """q ``[T, H, 576]``, kv_new ``[T, 576]`` (K; V is its first 512 dims) -> ``[T, H, 512]``."""
        t, h, d = q.shape
        q = q.view(batch, t // batch, h, d).transpose(1, 2)  # [B, H, L, 576]
        kv = kv_new.to(q.dtype).view(batch, 1, t // batch, d).expand(-1, h, -1, -1)  # [B, H, L, 576]
        out = F.scaled_dot_product_attention(q, kv, kv[..., :KV_LORA_RANK], is_causal=True, scale=self.sm_scale)
        return out.transpose(1, 2).reshape(t, h, KV_LORA_RANK)


def windows(data: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch_size, length]`` int64 windows of data at random offsets."""
    starts = torch.randint(0, data.numel() - length, (batch_size, 1), generator=generator, device=data.device)
    return data[starts + torch.arange(length, device=data.device)].long()


def schedule(steps: int, seconds: float, peak_lr: float, warmup: int = 100) -> Iterator[tuple[int, float]]:
    """(step, lr): linear warm-up, cosine decay to peak/10; ends after ``steps`` steps or ``seconds``,
    whichever comes first (progress counts both)."""
    start, step = time.perf_counter(), 0
    while (progress := max(step / steps, (time.perf_counter() - start) / seconds)) < 1:
        yield step, peak_lr * min(1.0, (step + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * progress))
        step += 1


def make_optimizer(params: list[torch.nn.Parameter], fused: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=fused)


class Trainer:
    """The target, its draft, the data splits and the run's settings."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.train_data = load_bytes(stdlib_files(heldout=False)).to(device)
        self.eval_data = load_bytes(stdlib_files(heldout=True)).to(device)
        print(f"stdlib bytes: {self.train_data.numel() / 1e6:.1f} MB training, {self.eval_data.numel() / 1e6:.2f} MB held out")
        torch.manual_seed(0)
        if args.init_from:
            self.target = load_deepseek(args.init_from, torch.float32, device)
            self.mtp = load_mtp(args.init_from, torch.float32, device, target=self.target)
        else:
            self.target = DeepseekV3ForCausalLM(tiny_config()).to(device)
            self.mtp = DeepseekMTP(self.target.config, target=self.target).to(device)
        self.attn = DenseCausalAttention(self.target.attn_spec().sm_scale)
        self.positions = torch.arange(args.seq_len, device=device).repeat(args.batch_size)  # [B * L]
        self.generator = torch.Generator(device).manual_seed(0)

    def autocast(self):
        return torch.autocast("cuda", torch.bfloat16) if self.device.type == "cuda" else nullcontext()

    def target_loss(self, x: torch.Tensor) -> torch.Tensor:
        """Next-byte cross-entropy (nats) of windows x ``[B, L + 1]``."""
        with self.autocast():
            hidden = self.target(x[:, :-1].flatten(), self.positions, self.attn, x.shape[0])
            return F.cross_entropy(self.target.compute_logits(hidden), x[:, 1:].flatten())

    def mtp_losses(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(soft cross-entropy vs the target, hidden regression, top-1 agreement, and the unrolled
        second step's cross-entropy and agreement) on windows x ``[B, L + 1]``.

        Draft position p: byte t_{p+1} and target hidden h_p in, target's distribution at p + 1 out.
        Unrolled: position p + 1 gets t_{p+2} and the draft's own o_p, target's distribution at p + 2 out."""
        b, n = x.shape[0], x.shape[1] - 1
        with self.autocast():
            with torch.no_grad():
                h = self.target(x[:, :-1].flatten(), self.positions, self.attn, b).view(b, n, -1)  # h_0 .. h_{L-1}
                want = self.target.compute_logits(h[:, 1:]).softmax(-1)  # [B, L - 1, V]: over t_2 .. t_L
            out = self.mtp(x[:, 1:].flatten(), self.positions, h.flatten(0, 1), self.attn, b).view(b, n, -1)
            logits = self.mtp.compute_logits(out[:, :-1])
            ce = F.cross_entropy(logits.flatten(0, 1), want.flatten(0, 1))
            reg = F.smooth_l1_loss(out[:, :-1].float(), h[:, 1:].float())
            positions = torch.arange(1, n, device=x.device).repeat(b)
            out2 = self.mtp(x[:, 2:].flatten(), positions, out[:, :-1].flatten(0, 1), self.attn, b).view(b, n - 1, -1)
            logits2 = self.mtp.compute_logits(out2[:, :-1])  # draft positions 1 .. L - 2
            ce2 = F.cross_entropy(logits2.flatten(0, 1), want[:, 1:].flatten(0, 1))
        agree = (logits.argmax(-1) == want.argmax(-1)).float().mean()
        return ce, reg, agree, ce2, (logits2.argmax(-1) == want[:, 1:].argmax(-1)).float().mean()

    def fit(self, name: str, params: list[torch.nn.Parameter], loss_fn, steps: int, seconds: float, lr: float) -> None:
        """Train params on loss_fn(windows) -> (loss, *logged); prints the running mean every log_every steps."""
        args, opt = self.args, make_optimizer(params, fused=self.device.type == "cuda")
        start, logged = time.perf_counter(), None
        for step, step_lr in schedule(steps, seconds, lr):
            for group in opt.param_groups:
                group["lr"] = step_lr
            loss, *rest = loss_fn(windows(self.train_data, args.batch_size, args.seq_len + 1, self.generator))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            vals = torch.stack([loss.detach(), *(r.detach() for r in rest)])
            logged = vals if logged is None else logged + vals
            if (step + 1) % args.log_every == 0:
                print(f"{name} step {step + 1:5d}  lr {step_lr:.2e}  {_fmt(logged / args.log_every)}  {time.perf_counter() - start:6.1f}s")
                logged = None
        print(f"{name}: {step + 1} steps in {time.perf_counter() - start:.1f}s")

    @torch.no_grad()
    def evaluate(self, loss_fn, batches: int = 8) -> torch.Tensor:
        """Mean of loss_fn's values over held-out windows (fixed seed)."""
        g = torch.Generator(self.device).manual_seed(1)
        args = self.args
        return torch.stack([torch.stack(loss_fn(windows(self.eval_data, args.batch_size, args.seq_len + 1, g)))
                            for _ in range(batches)]).mean(0)


def _fmt(vals: torch.Tensor) -> str:
    names = ("loss", "reg", "top1", "ce2", "top1_2")
    return "  ".join(f"{n} {v:.4f}" for n, v in zip(names, vals.tolist()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--target-steps", type=int, default=6000)
    ap.add_argument("--target-seconds", type=float, default=140.0, help="stop the target's training after this long")
    ap.add_argument("--mtp-steps", type=int, default=3000)
    ap.add_argument("--mtp-seconds", type=float, default=60.0, help="stop the draft's training after this long")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--reg-weight", type=float, default=1.0, help="weight of the draft's hidden-state regression")
    ap.add_argument("--unroll-weight", type=float, default=1.0, help="weight of the unrolled second draft step's loss")
    ap.add_argument("--init-from", metavar="DIR", help="load the target (kept as is) and draft from DIR; train the draft only")
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--force", action="store_true", help="overwrite the checkpoint in --out (the shipped model by default)")
    args = ap.parse_args()
    if (Path(args.out) / "config.json").exists() and not args.force:
        ap.error(f"{args.out} holds a checkpoint (by default the example's shipped model): pass --out DIR or --force")
    device = torch.device(args.device)
    t0 = time.perf_counter()
    tr = Trainer(args, device)
    target, mtp = tr.target, tr.mtp

    if not args.init_from:
        tr.fit("target", list(target.parameters()), lambda x: (tr.target_loss(x),), args.target_steps, args.target_seconds, args.lr)
    target.requires_grad_(False)  # the draft's embedding and head are the target's: frozen with it
    loss = tr.evaluate(lambda x: (tr.target_loss(x),))[0].item()
    print(f"target held-out: {loss:.4f} nats/byte = {loss / math.log(2):.3f} bits/byte")

    def mtp_loss(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ce, reg, top1, ce2, top1_2 = tr.mtp_losses(x)
        return ce + args.reg_weight * reg + args.unroll_weight * ce2, reg, top1, ce2, top1_2

    tr.fit("mtp", [p for p in mtp.parameters() if p.requires_grad], mtp_loss, args.mtp_steps, args.mtp_seconds, args.lr)
    print(f"mtp held-out: {_fmt(tr.evaluate(lambda x: tr.mtp_losses(x)))}  (loss: soft CE vs the target; top1: agreement)")
    print(f"training: {time.perf_counter() - t0:.1f}s wall clock")

    save_deepseek(target.to(torch.bfloat16), args.out, mtp=mtp.to(torch.bfloat16))
    reloaded = load_deepseek(args.out, torch.bfloat16, device)
    load_mtp(args.out, torch.bfloat16, device, target=reloaded)
    size = sum(p.stat().st_size for p in Path(args.out).iterdir())
    print(f"wrote {args.out}: {size / 1e6:.1f} MB (bf16), reloads")


if __name__ == "__main__":
    main()
