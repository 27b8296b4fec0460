"""Where a training run's memory goes: torch's own allocations by phase and op, beside the process's resident memory.

    python bench/memory_attribution.py --out FILE.json [--no-profile] CONFIG [key=value ...]
    accelerate launch ... bench/memory_attribution.py --out F.json --driver tests/train_driver.py --fsdp-cpu CONFIG ...

Runs `cascade_nb.train.train(cfg)` in this process (one process, the run's config and overrides as
`python -m cascade_nb.train` takes them) under `torch.profiler` with `profile_memory=True`, from the first line of
`train` on, so that every CPU allocation the run's thread makes is seen: weights, frozen encoders, optimizer state,
gradients, activations and temporaries. The model storages it cannot see are found by their addresses when the run
ends: those over memory-mapped weight files, and those allocated in other threads (transformers loads the CLIP
encoders in a thread pool). The training loop's phases are labelled from here (`record_function` around the mode's
`encode` and `loss`, the backward, the gradient norm, the optimizer step, the save; the library is unchanged), and
at the start and end of each phase this process's resident memory is read from /proc/self/status: `VmHWM` after a
reset of the high-water mark (`/proc/self/clear_refs`), so each phase has its own resident peak.

What it writes (one JSON file) and prints (one line per phase and a summary):
- per phase: the peak of bytes torch holds (`total_allocated` of the profiler's allocation events: the CPU twin of
  `torch.cuda.max_memory_allocated`), the resident peak and resident memory at its end;
- at the run's allocation peak: the bytes live by the phase and the op that allocated them (what the memory planner
  must count), largest first;
- the model storages the profiler did not see (`unseen`), by kind and module;
- the runtime's resident memory (the interpreter with the trainer's modules imported): with what torch holds and the
  mapped files, what is left of the resident peak is pages the C allocator keeps after torch freed them.

The in-training sample grid (`log_samples` after a save) is skipped: at the official size it takes ~25 minutes on a
CPU and is not part of a training update's memory. `--no-profile` records only the resident memory per phase (the
profiler's event buffers add to it); `--driver` runs a script that ends in `cascade_nb.train.main` (the FSDP2-on-CPU
driver of the tests) in place of `train(cfg)`, one JSON per process. Used by `bench/real_size.py --steps
attribute,fsdp`; bench/RESULTS.md quotes it.
"""
from __future__ import annotations
import argparse, contextlib, functools, json, os, runpy, sys, time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 1e9


def status_bytes(field: str) -> int:
    "A `kB` field of /proc/self/status, in bytes."
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak():
    "Start a new resident high-water mark (`VmHWM`) for this process (Linux: 5 > /proc/self/clear_refs)."
    with open("/proc/self/clear_refs", "w") as f: f.write("5")


class Phases:
    "Labels the loop's phases for the profiler and records each phase's resident peak."
    def __init__(self): self.records, self.storages, self.alive = [], {}, set()

    def wrap(self, name: str, fn):
        import torch
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            reset_peak()
            start = dict(phase=name, rss_start=status_bytes("VmRSS"), anon_start=status_bytes("RssAnon"))
            t = time.time()
            with torch.profiler.record_function(f"phase::{name}"):
                out = fn(*args, **kwargs)
            self.records.append({**start, "seconds": time.time() - t, "rss_peak": status_bytes("VmHWM"),
                                 "rss_end": status_bytes("VmRSS"),
                                 "anon_end": status_bytes("RssAnon")})
            return out
        return labelled


def label_phases(phases: Phases):
    "Wrap the trainer's steps in phase labels (module globals and classes the loop looks up at call time)."
    import accelerate
    import cascade_nb.train as T
    from cascade_nb.train_state import NonFiniteGuard
    build_models = T.build_models
    def build_labelled(cfg, acc):
        mode, net, gdf, ema = build_models(cfg, acc)
        phases.storages = model_storages(net, mode)
        mode.encode = phases.wrap("encode", mode.encode)
        mode.loss = phases.wrap("forward", mode.loss)
        return mode, net, gdf, ema
    T.build_models = phases.wrap("build", build_labelled)
    finish_run = T.finish_run
    def finish_labelled(run, *args, **kwargs):   # the built storages still alive when training ends
        phases.alive = {ptr for ptr, (*_, ref) in phases.storages.items() if ref() is not None}
        return finish_run(run, *args, **kwargs)
    T.finish_run = finish_labelled
    T.resume_run = phases.wrap("resume", T.resume_run)
    T.gradient_norm = phases.wrap("grad_norm", T.gradient_norm)
    T.save = phases.wrap("save", T.save)
    T.log_samples = lambda run, batch: None        # the sample grid: not an update's memory (see the docstring)
    accelerate.Accelerator.backward = phases.wrap("backward", accelerate.Accelerator.backward)
    NonFiniteGuard.step = phases.wrap("optimizer_step", NonFiniteGuard.step)


def model_storages(net, mode) -> dict[int, tuple]:
    """The storages of every tensor the run built (the trained net, and the mode's frozen models: text and image
    encoders, the latent space's encoder and previewer), as built: data pointer -> (bytes, the module it belongs to,
    whether it lies in a memory-mapped file, a weak reference to a tensor on it: FSDP replaces the built weights by
    shards, and only the storages still alive at the end count)."""
    import weakref
    from torch import nn
    modules = {"net": net, **{k: v for k, v in vars(mode).items() if isinstance(v, nn.Module) and k != "net"},
               **{f"space.{k}": v for k, v in vars(getattr(mode, "space", None) or object()).items()
                  if isinstance(v, nn.Module)}}
    maps, out = file_mappings(), {}
    for name, m in modules.items():
        for t in [*m.parameters(), *m.buffers()]:
            ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            mapped = any(a <= ptr < b for a, b, _ in maps)
            out.setdefault(ptr, (nbytes, name, mapped, weakref.ref(t)))
    return out


def file_mappings() -> list[tuple[int, int, str]]:
    "This process's memory-mapped files (/proc/self/maps): (start, end, path)."
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith("/"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[5].strip()))
    return out


def unseen_storages(storages: dict, alive: set, seen: set) -> dict:
    """The model storages alive when training ended that no allocation event of the profile made, by where they live: a
    memory-mapped weight file (page cache: resident once read, shared), or memory allocated outside the profiled
    thread (transformers loads the CLIP encoders in a thread pool, which the profiler does not see); bytes per
    (kind, module)."""
    out = defaultdict(int)
    for ptr, (nbytes, module, mapped, ref) in storages.items():
        if ptr in seen or nbytes == 0 or ptr not in alive: continue
        out[f"{'memory-mapped file' if mapped else 'allocated in another thread'}: {module}"] += nbytes
    return dict(out)


def torch_held(result: dict) -> tuple[int, int, int]:
    """From a profiled result: (bytes torch holds at its allocation peak, counting the model storages allocated in
    other threads; those bytes alone; bytes of model storages over memory-mapped weight files)."""
    other = sum(v for k, v in result["unseen"].items() if k.startswith("allocated"))
    mapped = sum(v for k, v in result["unseen"].items() if k.startswith("memory-mapped"))
    return result["peak_allocated"] + other, other, mapped


def allocations(prof):
    """Every allocation event of the profile in time order: (time_ns, ptr, bytes (negative: a free), torch's total
    after it, phase, op), the op being the innermost torch op or label around it."""
    from torch._C._profiler import _EventType
    out = []
    def walk(node, phase, op):
        name = node.name
        if name.startswith("phase::"): phase = name[len("phase::"):]
        elif node.tag != _EventType.Allocation: op = name
        if node.tag == _EventType.Allocation:
            a = node.extra_fields
            if a.device.type == "cpu":
                out.append((node.start_time_ns, a.ptr, a.alloc_size, a.total_allocated, phase, op))
        for c in node.children: walk(c, phase, op)
    for root in prof.profiler.kineto_results.experimental_event_tree(): walk(root, "setup", "(python)")
    out.sort(key=lambda e: e[0])
    return out


def attribute(events):
    "The allocation peak, each phase's peak, and the bytes live at the run's peak by (phase, op)."
    peak_i = max(range(len(events)), key=lambda i: events[i][3])
    live, before = {}, 0
    for t, ptr, size, total, phase, op in events[:peak_i + 1]:
        # a storage over a memory-mapped file is reported too, but torch's total does not count it: left out here
        if size > 0 and total == before + size: live[ptr] = (size, phase, op)
        elif size < 0: live.pop(ptr, None)
        before = total
    by_op, by_phase = defaultdict(int), defaultdict(int)
    for size, phase, op in live.values():
        by_op[(phase, op)] += size
        by_phase[phase] += size
    phase_peak = defaultdict(int)
    for t, ptr, size, total, phase, op in events: phase_peak[phase] = max(phase_peak[phase], total)
    return dict(live_ptrs=set(live), peak_allocated=events[peak_i][3], peak_phase=events[peak_i][4],
                peak_op=events[peak_i][5],
                live_at_peak_by_phase=dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
                live_at_peak_by_op=[dict(phase=p, op=o, bytes=b) for (p, o), b in
                                    sorted(by_op.items(), key=lambda kv: -kv[1])[:40]],
                phase_peak_allocated=dict(phase_peak))


UPDATE_PHASES = ("encode", "forward", "backward", "grad_norm", "optimizer_step")


def update_seconds(records) -> list[float]:
    "Seconds of each update: its phases from `encode` (the first of an update) to the optimizer step."
    out = []
    for r in records:
        if r["phase"] == "encode": out.append(0.)
        if out and r["phase"] in UPDATE_PHASES: out[-1] += r["seconds"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--no-profile", action="store_true",
                   help="only the resident memory per phase: the profiler's event buffers add to the resident peak")
    p.add_argument("--driver", type=Path, help="a script that ends by calling cascade_nb.train.main (e.g. "
                   "tests/train_driver.py --fsdp-cpu): run it with the other options in place of train(cfg); under "
                   "a multi-process launch each process writes OUT with _rankN before its suffix")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    args, driver_options = p.parse_known_args(argv)
    if driver_options and args.driver is None: p.error(f"unrecognized arguments: {' '.join(driver_options)}")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        args.out = args.out.with_name(f"{args.out.stem}_rank{os.environ['RANK']}{args.out.suffix}")
    import torch
    from torch.profiler import profile, ProfilerActivity
    runtime = status_bytes("VmRSS")           # the interpreter with torch imported
    import cascade_nb.train as T
    from cascade_nb.config import load_config
    from cascade_nb.cli import cli_errors
    imported = status_bytes("VmRSS")          # ... and the trainer's modules
    phases = Phases()
    label_phases(phases)
    with cli_errors(): cfg = load_config(args.config, args.overrides)   # a bad config or key: one line, exit 2
    reset_peak()
    t0 = time.time()
    with contextlib.nullcontext() if args.no_profile else profile(activities=[ProfilerActivity.CPU],
                                                                  profile_memory=True) as prof:
        if args.driver is None: out = T.train(cfg)
        else:   # the driver's own patches (e.g. FSDP2 on CPU processes) around the same train()
            sys.argv, out = [str(args.driver), *driver_options, args.config, *args.overrides], None
            runpy.run_path(str(args.driver), run_name="__main__")
    wall = time.time() - t0
    rss_peak = max(r["rss_peak"] for r in phases.records)
    del out
    result = dict(config=args.config, overrides=args.overrides, wall_s=wall, runtime_rss=runtime,
                  imported_rss=imported, rss_peak=rss_peak, update_s=update_seconds(phases.records),
                  phases=phases.records)
    if not args.no_profile:
        found = attribute(allocations(prof))
        result["unseen"] = unseen_storages(phases.storages, phases.alive, found.pop("live_ptrs"))
        result.update(found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in phases.records:
        print(f"memory_attribution phase {r['phase']}: resident peak {r['rss_peak'] / GB:.2f} GB, end "
              f"{r['rss_end'] / GB:.2f} GB (anonymous {r['anon_end'] / GB:.2f} GB)")
    print(f"memory_attribution: resident peak {rss_peak / GB:.2f} GB; runtime {imported / GB:.2f} GB; "
          f"updates of {', '.join(f'{x:.0f}' for x in result['update_s'])} s; {wall:.0f} s in all", flush=True)
    if args.no_profile: return
    print(f"memory_attribution: torch allocation peak {result['peak_allocated'] / GB:.2f} GB in "
          f"{result['peak_phase']} ({result['peak_op']})")
    unseen = result["unseen"]
    for kind, nbytes in unseen.items():
        print(f"memory_attribution: not seen by the profiler, {kind}: {nbytes / GB:.2f} GB")
    for row in result["live_at_peak_by_op"][:15]:
        print(f"  live at the peak: {row['bytes'] / GB:6.3f} GB  {row['phase']:<15} {row['op']}")


if __name__ == "__main__":
    main()
