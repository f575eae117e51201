"""Train a byte-level GPT on the King James Gospels and Acts across pipeline stages.

    torchrun --nproc_per_node=2 examples/train_gpt.py                  # 1F1B on 2 stages
    torchrun --nproc_per_node=2 examples/train_gpt.py --schedule interleaved
    torchrun --nproc_per_node=2 examples/train_gpt.py --schedule zb-h1
    torchrun --nproc_per_node=2 examples/train_gpt.py --plan plan.json  # a plan from the CLI
    torchrun --nproc_per_node=4 examples/train_gpt.py --stages 2       # 2 stages x 2 replicas
    python examples/train_gpt.py --single-process                      # the same run, no pipeline

The model is examples.models.gpt (token + position embedding, causal self-attention blocks, a
head tied to the embedding) reading the text as bytes; the last 5% of the text is held out.
Without ``--plan`` the first rank profiles the model (pipetrain.profile) and plans its split
(partitioner.plan) into ``--stages`` stages (default: one per rank) before training; the plan is
made for 1F1B whatever ``--schedule`` says (the planner's balance serves the other schedules too:
interleaved gets a plan for twice the stages). The world is ``--stages`` x replicas ranks: each
replica trains on its share of every batch and the replicas average their gradients.
Training: AdamW, linear warm-up then cosine decay of the learning rate, gradients clipped to a
global norm of 1.0, bf16 autocast where the processor computes bf16 natively (``--precision
auto``; elsewhere fp32, since emulated bf16 is several times slower). The pipeline saves a
checkpoint in ``--checkpoint-dir`` at the start, every ``--checkpoint-every`` steps and at the
end; when torchrun restarts the job (``--max-restarts``) after a rank died, or with
``--resume``, it resumes from the newest one, on the batches an uninterrupted run would see
(pipetrain/checkpoints/restart.py). A folder that holds an earlier run's checkpoints is
refused unless ``--resume`` or ``--fresh`` (a new run beside them; they are kept). At the end
every rank evaluates the held-out loss, and the first rank consolidates the checkpoint into
one model and prints a sample of generated text.
``--single-process`` trains the same model on the same batches in one process with plain
PyTorch (torch.nn.utils.clip_grad_norm_, torch.autocast): the reference for the pipelined run.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from models import gpt, lm_loss
from text import held_out_batches, load_corpus, sample, training_batches
from torch import nn

import partitioner
import pipetrain

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
PROMPT = "And Jesus said unto them, "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", choices=["1f1b", "interleaved", "zb-h1"],
                        help="default: the plan's, or 1f1b")
    parser.add_argument("--plan", help="a plan JSON from `pipetrain plan` (else: profile and plan)")
    parser.add_argument("--stages", type=int,
                        help="ranks per pipeline; the world is stages x replicas (default: the "
                        "plan's ranks, or every rank: no replicas)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, help="windows per step (default 16, or the plan's)")
    parser.add_argument("--chunks", type=int, help="micro-batches (default 4, or the plan's)")
    parser.add_argument("--context", type=int, default=128, help="bytes per window")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: a tenth of --steps)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="auto: bf16 where the processor computes in it natively, else fp32")
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also print the held-out loss every N steps (0: at the end only)")
    parser.add_argument("--checkpoint-dir", default="gpt-checkpoint",
                        help="where checkpoints go (default ./gpt-checkpoint; a folder every "
                        "node sees)")
    parser.add_argument("--checkpoint-every", type=int, default=50,
                        help="save every N steps (0: at the start and end only)")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the newest checkpoint in --checkpoint-dir (automatic "
                        "when torchrun restarts the job)")
    parser.add_argument("--fresh", action="store_true",
                        help="start a new run in a --checkpoint-dir that holds an earlier run's "
                        "checkpoints, keeping them (without it, or --resume, such a folder is "
                        "refused)")
    parser.add_argument("--single-process", action="store_true",
                        help="train without a pipeline, in this process")
    parser.add_argument("--no-sample", action="store_true", help="skip the generated text")
    parser.add_argument("--sample-length", type=int, default=300)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.single_process and (args.plan or args.schedule or args.stages or args.resume
                                or args.fresh):
        parser.error("--single-process runs no pipeline: leave out --plan, --schedule, --stages, "
                     "--resume and --fresh")
    if args.stages is not None and args.stages < 1:
        parser.error(f"--stages must be at least 1, got {args.stages}")
    if args.precision == "auto":
        args.precision = "bf16" if native_bf16() else "fp32"
    return args


def native_bf16() -> bool:
    """Whether this machine computes bf16 natively: a GPU, or a CPU with AVX512-BF16 or AMX.
    Elsewhere PyTorch emulates it on the CPU, about ten times slower than fp32 (measured on
    the 2-core AVX2 development machine), so autocast would only cost time."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def build_model(args: argparse.Namespace, device: str | None = None) -> nn.Sequential:
    """The GPT; on ``device="meta"`` shapes only, each rank then materializing its own stage
    with the weights the eager build gets (pipetrain's per-layer rule from ``--seed``)."""
    return gpt(dim=args.dim, blocks=args.blocks, heads=args.heads, context=args.context,
               dropout=args.dropout, seed=args.seed, device=device)


def lr_factor(steps: int, warmup: int):
    """The learning rate's multiplier at each step: linear warm-up over ``warmup`` steps, then
    a cosine decay to a tenth at the last step."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def adamw(lr: float):
    return lambda params: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def warmup_cosine(args: argparse.Namespace):
    warmup = args.warmup if args.warmup is not None else max(args.steps // 10, 1)
    factor = lr_factor(args.steps, warmup)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def eval_batch(args: argparse.Namespace) -> int:
    """Windows per evaluation batch: at least 64 (fewer, larger steps through the pipeline),
    a multiple of the micro-batch count."""
    return -(-max(args.batch, 64) // args.chunks) * args.chunks


def log(step: int, args: argparse.Namespace, loss: float, lr: float, norm: float | None,
        tokens: int, elapsed: float) -> None:
    clip = f"  grad norm {norm:6.3f}" if norm is not None else ""
    print(f"step {step:4d}/{args.steps}  loss {loss:.4f}  lr {lr:.2e}{clip}  "
          f"{tokens / elapsed:8,.0f} tokens/s", flush=True)


def print_sample(model: nn.Module, args: argparse.Namespace) -> None:
    text = sample(model, PROMPT, args.sample_length, args.context, seed=args.seed)
    print(f"sample (temperature 0.8, seed {args.seed}):\n{text}", flush=True)


# -- the pipelined run ----------------------------------------------------------------------------


def make_plan(model: nn.Sequential, args: argparse.Namespace, stages: int,
              size: int, replicas: int) -> partitioner.Plan:
    """Profile ``model`` on one micro-batch of ``size`` windows and plan ``stages`` stages (as
    1F1B: see the module's docstring) in ``replicas`` copies, timing with one thread as each
    stage will run."""
    tokens = torch.randint(0, 256, (size, args.context), generator=torch.Generator().manual_seed(0))
    profile = pipetrain.profile(model, tokens, optimizer="adamw", warmup=1, repeats=3)
    return partitioner.plan(profile, stages=stages, microbatches=args.chunks, schedule="1f1b",
                            cores=torch.get_num_threads() * stages, data_parallel=replicas)


def shared_plan(model: nn.Sequential, args: argparse.Namespace, ranks: int,
                size: int, replicas: int) -> partitioner.Plan:
    """The first rank's plan for ``replicas`` pipelines of ``ranks`` ranks, on every rank (each
    rank profiling on its own could split differently)."""
    stages = 2 * ranks if args.schedule == "interleaved" else ranks
    box: list[str | None] = [None]
    if dist.get_rank() == 0:
        start = time.perf_counter()
        box[0] = make_plan(model, args, stages, size, replicas).to_json()
        print(f"profiled and planned in {time.perf_counter() - start:.1f} s", flush=True)
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return partitioner.Plan.from_json(box[0])


def ranks_per_pipeline(args: argparse.Namespace, plan: partitioner.Plan | None, world: int) -> int:
    """``--stages``, else the plan's ranks, else every rank; refused unless it divides the
    world into replicas."""
    planned = plan.pipeline_ranks if plan is not None else None
    if args.stages and planned and args.stages != planned:
        raise SystemExit(f"--stages {args.stages} contradicts {args.plan}, which runs {planned} "
                         f"ranks per pipeline: leave out --stages, or plan again with "
                         f"`pipetrain plan --stages {args.stages}`")
    ranks = args.stages or planned or world
    if world % ranks:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise SystemExit(f"{ranks} stages do not divide the {world} ranks into replicas (the "
                         f"world is stages x replicas): launch a multiple of {ranks} ranks, or "
                         f"pass --stages as one of {fits}")
    return ranks


def batch_layout(args: argparse.Namespace, plan: partitioner.Plan | None, replicas: int) -> None:
    """Fill in ``--batch`` (windows per step, over all replicas) and ``--chunks`` from the plan
    or the defaults; refuse a batch that the replicas' micro-batches do not divide."""
    if plan is not None:
        args.chunks = args.chunks or plan.microbatches
        args.batch = args.batch or plan.microbatches * plan.microbatch_size * replicas
    else:
        args.batch, args.chunks = args.batch or 16, args.chunks or 4
    if args.batch % (replicas * args.chunks):
        raise SystemExit(f"--batch {args.batch} does not split into {replicas} replica(s) x "
                         f"{args.chunks} micro-batches: pass a multiple of "
                         f"{replicas * args.chunks}")


def evaluate_pipelined(pipe: pipetrain.Pipeline, held_out: list) -> float:
    """The mean next-byte loss over the held-out windows, on every rank (each replica
    evaluates its share of the batches)."""
    total = torch.zeros((), dtype=torch.float64)
    replica, replicas = pipe.placement.replica, pipe.placement.replicas
    for x, y in held_out[replica::replicas]:
        logits = pipe.eval_step(x)
        if logits is not None:  # on each replica's last stage
            total += lm_loss(logits.float(), y).double()
    dist.all_reduce(total)
    return total.item() / len(held_out)


def train_steps(pipe: pipetrain.Pipeline, args: argparse.Namespace, train: torch.Tensor,
                held_out: list) -> float:
    """Train from ``pipe.step`` (0, or the step resumed from) to ``--steps``, each replica on
    its share of every batch, saving every ``--checkpoint-every`` steps; the seconds it took."""
    first, rank = pipe.step, dist.get_rank()
    share = args.batch // pipe.placement.replicas
    mine = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
    batches = training_batches(train, args.batch, args.context, args.seed, start=first)
    start = time.perf_counter()
    while pipe.step < args.steps:
        x, y = next(batches)
        loss = pipe.train_step(x[mine], y[mine])
        step = pipe.step
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            pipe.save(args.checkpoint_dir)
        if rank == 0 and (step % args.log_every == 0 or step in (first + 1, args.steps)):
            metrics = pipe.metrics
            log(step, args, float(loss), metrics["lr"], metrics.get("grad_norm"),
                (step - first) * args.batch * args.context, time.perf_counter() - start)
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            value = evaluate_pipelined(pipe, held_out)
            if rank == 0:
                print(f"step {step:4d}  validation loss {value:.4f}", flush=True)
    return time.perf_counter() - start


def train_pipelined(args: argparse.Namespace) -> None:
    rank, world = pipetrain.init_distributed()
    torch.set_num_threads(1)  # one core per stage on a small machine
    model = build_model(args, device="meta")  # no rank builds the whole model
    params = sum(p.numel() for p in model.parameters())  # before the stages take their layers:
    # the tied weight is one Parameter here, counted once (on each rank its own copy after)
    plan = partitioner.Plan.load(args.plan) if args.plan else None
    ranks = ranks_per_pipeline(args, plan, world)
    replicas = world // ranks
    batch_layout(args, plan, replicas)
    size = args.batch // (replicas * args.chunks)  # windows per micro-batch
    plan = plan or shared_plan(model, args, ranks, size, replicas)
    schedule = args.schedule or plan.schedule
    pipe = pipetrain.Pipeline(
        model, plan=plan, schedule=schedule, chunks=args.chunks, replicas=replicas,
        loss_fn=lm_loss, optimizer=adamw(args.lr), lr_scheduler=warmup_cosine(args),
        clip_grad_norm=args.clip, precision=args.precision, init_seed=args.seed,
    )
    try:  # the ranks decide together; an earlier run's checkpoints are refused, not trained over
        resumed = pipetrain.start_or_resume(pipe, args.checkpoint_dir, args.resume, args.fresh)
    except pipetrain.CheckpointError as error:
        raise SystemExit(f"train_gpt.py: {error}") from None
    train, held = load_corpus()
    held_out = held_out_batches(held, eval_batch(args), args.context)
    if rank == 0:
        print(f"GPT of {params:,} parameters, {len(train):,} training bytes, "
              f"{len(held_out) * eval_batch(args) * args.context:,} held out; {world} ranks "
              f"({replicas} replica(s) x {ranks} ranks), {schedule}, balance {pipe.balance}, "
              f"{args.chunks} micro-batches of {size} x {args.context} bytes, {args.precision}",
              flush=True)
        if resumed is not None:
            print(f"resumed from step {resumed} of {args.checkpoint_dir}", flush=True)
    elapsed = train_steps(pipe, args, train, held_out)
    pipe.save(args.checkpoint_dir)  # nothing new when the last periodic save was this step
    value = evaluate_pipelined(pipe, held_out)
    if rank == 0:
        print(f"trained {args.steps - (resumed or 0)} steps in {elapsed:.1f} s; checkpoint in "
              f"{args.checkpoint_dir}")
        print(f"validation loss {value:.4f} (uniform over bytes: {math.log(256):.4f})", flush=True)
    dist.barrier()  # the checkpoint is complete on disk
    if rank == 0 and not args.no_sample:
        whole = build_model(args)
        whole.load_state_dict(pipetrain.consolidate(args.checkpoint_dir))
        print_sample(whole, args)
    pipetrain.shutdown()


# -- the reference: the same training in one process ----------------------------------------------


def evaluate_single(model: nn.Module, held_out: list, precision: str) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad(), _autocast(precision):
        for x, y in held_out:
            total += lm_loss(model(x).float(), y).item()
    model.train()
    return total / len(held_out)


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=AUTOCAST.get(precision), enabled=precision in AUTOCAST)


def train_single(args: argparse.Namespace) -> None:
    """The pipelined run's training in plain PyTorch: the whole batch at once (its mean loss
    is the mean of the micro-batches' mean losses), one optimizer, one scheduler."""
    if args.precision == "fp16":
        raise SystemExit("--single-process runs fp32 or bf16 (fp16 needs a loss scaler)")
    args.batch, args.chunks = args.batch or 16, args.chunks or 4
    model = build_model(args)
    optimizer = adamw(args.lr)(model.parameters())
    scheduler = warmup_cosine(args)(optimizer)
    train, held = load_corpus()
    held_out = held_out_batches(held, eval_batch(args), args.context)
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT of {params:,} parameters, single process ({torch.get_num_threads()} threads), "
          f"batch {args.batch} x {args.context} bytes, {args.precision}", flush=True)
    batches = training_batches(train, args.batch, args.context, args.seed)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        lr = scheduler.get_last_lr()[0]
        with _autocast(args.precision):
            loss = lm_loss(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        norm = float(nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        optimizer.step()
        scheduler.step()
        if step % args.log_every == 0 or step in (1, args.steps):
            log(step, args, loss.item(), lr, norm, step * args.batch * args.context,
                time.perf_counter() - start)
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            print(f"step {step:4d}  validation loss "
                  f"{evaluate_single(model, held_out, args.precision):.4f}", flush=True)
    elapsed = time.perf_counter() - start
    folder = Path(args.checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "single-process.pt")
    print(f"trained {args.steps} steps in {elapsed:.1f} s; checkpoint in {folder}")
    print(f"validation loss {evaluate_single(model, held_out, args.precision):.4f} "
          f"(uniform over bytes: {math.log(256):.4f})", flush=True)
    if not args.no_sample:
        print_sample(model, args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.single_process:
        train_single(args)
    else:
        train_pipelined(args)


if __name__ == "__main__":
    main()
