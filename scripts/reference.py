#!/usr/bin/env python3
"""Writes reference files for whale's GPT-2 and Llama models from transformers' own code.

Run it through scripts/reference, which installs what it needs (Debian's
python3-torch, transformers 4.40 from PyPI in .deps/reference-venv) and then
runs this file with the venv's Python.

  scripts/reference                          both tiny configurations, into tests/reference/
  scripts/reference --full gpt2_124m OUTDIR  GPT-2 124M's shape (B=4, T=64) into OUTDIR, then whale's
                                             check against them (build/tests/mpi_reference, or $WHALE_REFERENCE_TEST)

Each output folder gets config.json and model.safetensors (save_pretrained of
the untrained model) and reference.safetensors (one batch, its logits, loss and
every parameter's gradient, and 10 AdamW steps' losses). tests/reference/README.md
describes the files. Everything is fp32 on the CPU with one thread and
deterministic algorithms, so a rerun with the same versions writes the same bytes.
"""

import os

# One thread everywhere (torch's own pool and the BLAS under it): reproducible bytes.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
import safetensors
from safetensors import safe_open
from safetensors.torch import load_file, save
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234  # torch.manual_seed before building a model (transformers' initialisation)
PERTURB_SEED = SEED + 1  # generator for the perturbation of constant parameters
DATA_SEED = SEED + 2  # generator for the batch's tokens
PERTURB = 0.1  # constant parameters get uniform(-PERTURB, PERTURB) added

# AdamW and clipping (max_grad_norm is per configuration, below).
LR = 1e-3
BETA1 = 0.9
BETA2 = 0.999
EPS = 1e-8
WEIGHT_DECAY = 0.01
STEPS = 10


def gpt2_tiny():
    return GPT2LMHeadModel, GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        layer_norm_epsilon=1e-5, activation_function="gelu_new",
        attn_implementation="eager")


def llama_tiny():
    return LlamaForCausalLM, LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=False, attention_dropout=0.0, hidden_act="silu",
        attn_implementation="eager")


def gpt2_124m():
    # transformers' default GPT2Config is GPT-2 124M: 12 layers, 768 wide, 12 heads,
    # 1024 positions, vocabulary 50257, gelu_new, tied head.
    return GPT2LMHeadModel, GPT2Config(
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        attn_implementation="eager")


# name: (model, B, T, max_grad_norm). Each tiny max_grad_norm sits between the
# grad norms of its 10 steps, so that clipping triggers in some steps and not in
# others (the script prints which).
TINY = {"gpt2-tiny": (gpt2_tiny, 4, 16, 1.1), "llama-tiny": (llama_tiny, 4, 16, 1.5)}
FULL = {"gpt2_124m": (gpt2_124m, 4, 64, 1.0)}


def build(make):
    """The model as transformers initialises it from SEED, fp32, with its constant
    parameters (biases, norm gains) perturbed. Returns (model, perturbed names)."""
    cls, config = make()
    torch.manual_seed(SEED)
    model = cls(config).to(torch.float32)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    gen = torch.Generator().manual_seed(PERTURB_SEED)
    perturbed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.reshape(-1)
            if bool((flat == flat[0]).all()):
                noise = torch.empty(p.shape, dtype=torch.float32).uniform_(-PERTURB, PERTURB, generator=gen)
                p.add_(noise)
                perturbed.append(name)
    model.train()  # every dropout probability is 0, so train and eval agree
    return model, perturbed


def batch(vocab, B, T):
    """Random tokens; targets[:, t] = input_ids[:, t + 1], the last one random too."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=gen, dtype=torch.int64)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def debian_version(package):
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save_sorted(tensors, path, metadata):
    """safetensors.torch.save's file with the metadata keys in sorted order.

    safetensors keeps the metadata in a hash map, so the key order in its JSON
    header (and with it the file's bytes) changes from run to run. The header is
    rewritten with sorted metadata (tensor entries and data untouched, padded with
    spaces to a multiple of 8 bytes as safetensors does), so reruns give the same bytes."""
    raw = save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode("ascii")
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def generate(label, make, B, T, max_grad_norm, out):
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model, perturbed = build(make)
    cfg = model.config
    V = cfg.vocab_size
    input_ids, targets = batch(V, B, T)

    # The untrained model, as transformers saves it.
    model.save_pretrained(out, safe_serialization=True)
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()

    # One forward and backward on the batch.
    model.zero_grad(set_to_none=True)
    logits = model(input_ids).logits
    assert logits.dtype == torch.float32 and logits.shape == (B, T, V), (logits.dtype, logits.shape)
    loss = loss_of(logits, targets)
    loss.backward()
    tensors = {
        "input_ids": input_ids,
        "targets": targets,
        "logits": logits.detach().clone(),
        "loss": loss.detach().reshape(1).clone(),
    }
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        tensors["grad." + name] = p.grad.detach().clone()
    del model

    # 10 AdamW steps on the same batch from the same initial weights.
    model, _ = build(make)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(BETA1, BETA2), eps=EPS,
                            weight_decay=WEIGHT_DECAY, amsgrad=False, maximize=False, foreach=False)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        step_loss = loss_of(model(input_ids).logits, targets)
        step_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(step_loss.detach().reshape(()))
        norms.append(norm.detach().reshape(()).to(torch.float32))
    with torch.no_grad():
        final = loss_of(model(input_ids).logits, targets)
    tensors["adamw_losses"] = torch.stack(losses).to(torch.float32)
    tensors["adamw_grad_norms"] = torch.stack(norms)
    tensors["adamw_final_loss"] = final.detach().reshape(1).to(torch.float32)
    assert torch.equal(tensors["adamw_losses"][0:1], tensors["loss"]), "step 1's loss differs from the reference loss"
    del model

    clipped = [i + 1 for i, n in enumerate(norms) if float(n) + 1e-6 > max_grad_norm]
    metadata = {
        "name": label,
        "model_class": make()[0].__name__,
        "B": str(B),
        "T": str(T),
        "vocab": str(V),
        "seed": str(SEED),
        "init": ("torch.manual_seed(seed), then the model's constructor (transformers' own "
                 "initialisation), fp32"),
        "perturbation": (f"parameters whose elements were all equal after construction got "
                         f"uniform(-{PERTURB}, {PERTURB}) added, drawn in named_parameters() order "
                         f"from torch.Generator().manual_seed({PERTURB_SEED})"),
        "perturbed": ",".join(perturbed),
        "data": (f"tokens = torch.randint(0, vocab, (B, T+1), generator=torch.Generator()"
                 f".manual_seed({DATA_SEED})); input_ids = tokens[:, :-1]; targets = tokens[:, 1:]"),
        "loss": "torch.nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1)), mean over B*T",
        "lr": repr(LR),
        "beta1": repr(BETA1),
        "beta2": repr(BETA2),
        "eps": repr(EPS),
        "weight_decay": repr(WEIGHT_DECAY),
        "max_grad_norm": repr(max_grad_norm),
        "steps": str(STEPS),
        "clipped_steps": ",".join(map(str, clipped)),
        "optimizer": ("torch.optim.AdamW(model.parameters(), foreach=False), one group, "
                      "weight decay on every parameter"),
        "clipping": ("torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm): "
                     "coef = min(1, max_grad_norm / (total_norm + 1e-6)), before each step"),
        "attn_implementation": "eager",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "torch_debian_package": "python3-torch " + debian_version("python3-torch"),
    }
    ref = out / "reference.safetensors"
    save_sorted(tensors, ref, metadata)

    # Checks: the saved model loads back and gives the same logits; the file reads back.
    back = make()[0].from_pretrained(out, attn_implementation="eager", torch_dtype=torch.float32)
    with torch.no_grad():
        back_logits = back(input_ids).logits
    if not torch.equal(back_logits, tensors["logits"]):
        diff = (back_logits - tensors["logits"]).abs().max().item()
        raise SystemExit(f"scripts/reference: {label}: logits of the reloaded model differ (max |diff| {diff:g})")
    stored = load_file(str(ref))
    for k, v in tensors.items():
        if not torch.equal(stored[k], v):
            raise SystemExit(f"scripts/reference: {label}: {k} does not read back from {ref}")
    with safe_open(str(ref), framework="pt") as f:
        if f.metadata() != metadata:
            raise SystemExit(f"scripts/reference: {label}: the metadata does not read back from {ref}")

    n_params = sum(p.numel() for p in back.parameters())
    sizes = ", ".join(f"{f.name} {f.stat().st_size / 1e6:.2f} MB" for f in sorted(out.iterdir()) if f.is_file())
    print(f"{label}: {metadata['model_class']}, {n_params} parameters, B={B} T={T} V={V}")
    print(f"  loss {loss.item():.6f}; AdamW losses {losses[0].item():.4f} .. {losses[-1].item():.4f}, "
          f"after step {STEPS}: {final.item():.4f}")
    print(f"  grad norms {' '.join(f'{float(n):.3f}' for n in norms)}; clipped at steps {clipped or 'none'}")
    print(f"  perturbed {len(perturbed)} constant parameters; reloaded logits equal")
    print(f"  {out}: {sizes} ({time.perf_counter() - t0:.1f} s)")


# bench_workloads' llama-small (bench/bench_common.hpp): the same shape, batch and optimizer.
BENCH = {
    "llama-small": dict(config=dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
                        batch=16, seq=128),
    # gpt's shape with GPT-2's tied head (bench_workloads' gpt2-small)
    "gpt2-small": dict(gpt2=True, config=dict(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4),
                       batch=16, seq=128),
}


def bench(name):
    """transformers' training step (forward, loss, backward, SGD with momentum) on one thread, timed."""
    w = BENCH[name]
    if w.get("gpt2"):
        cfg = transformers.GPT2Config(**w["config"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      layer_norm_epsilon=1e-5, activation_function="gelu_new")
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(**w["config"], rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                       attention_bias=False, attention_dropout=0.0, hidden_act="silu")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    B, T, V = w["batch"], w["seq"], w["config"]["vocab_size"]
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    secs = []
    for step in range(7):
        t0 = time.perf_counter()
        logits = model(ids).logits
        loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        secs.append(time.perf_counter() - t0)
    step_s = sorted(secs[2:])[len(secs[2:]) // 2]
    print(json.dumps({"workload": name, "implementation": "transformers", "transformers": transformers.__version__,
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "attn_implementation":
                      model.config._attn_implementation, "step_s": step_s, "tokens_per_s": B * T / step_s,
                      "loss_last": float(loss)}))


def check_export(folder):
    """whale's export, loaded by transformers: its logits on the batch whale ran against whale's own."""
    import numpy as np
    for name in ("config.json", "model.safetensors", "batch.safetensors", "whale_logits.f32"):
        if not (folder / name).is_file():
            print(f"scripts/reference: --check-export: {folder / name} is missing (the test mpi_reference writes "
                  f"these when WHALE_HF_EXPORT_DIR names the folder)", file=sys.stderr)
            raise SystemExit(2)
    config = json.loads((folder / "config.json").read_text())
    cls = {"LlamaForCausalLM": transformers.LlamaForCausalLM,
           "GPT2LMHeadModel": transformers.GPT2LMHeadModel}[config["architectures"][0]]
    model = cls.from_pretrained(folder, attn_implementation="eager").eval()
    ids = load_file(folder / "batch.safetensors")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    mine = np.fromfile(folder / "whale_logits.f32", dtype=np.float32).reshape(logits.shape)
    diff = float(np.abs(mine - logits).max())
    print(f"{folder}: {config['architectures'][0]} loaded by transformers {transformers.__version__} from whale's export; "
          f"max |whale - transformers| over {logits.size} logits: {diff:.2e} (largest logit {float(np.abs(logits).max()):.3f})")
    if not diff <= 1e-5:
        raise SystemExit(1)


def compare_full(outdir):
    """whale's GPT-2 124M against the files just written: the test mpi_reference's full-size case, in one process."""
    exe = Path(os.environ.get("WHALE_REFERENCE_TEST", ROOT / "build" / "tests" / "mpi_reference"))
    case = "-tc=GPT-2 124M*"
    if not exe.is_file():
        print(f"scripts/reference: {exe} is not built, so whale was not compared; build it (scripts/test), then run\n"
              f"  WHALE_REFERENCE_FULL={outdir} {exe} '{case}'")
        return
    env = dict(os.environ, WHALE_REFERENCE_FULL=str(outdir.resolve()), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    r = subprocess.run([str(exe), case, "--no-colors"], env=env, capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        if "against transformers" in line or "ERROR" in line or "logged" in line or "values" in line:
            print(line.strip())
    print(f"scripts/reference: whale's check of {outdir} {'passed' if r.returncode == 0 else 'FAILED'} "
          f"in {time.perf_counter() - t0:.0f} s")
    if r.returncode != 0:
        raise SystemExit(1)


USAGE = """usage: scripts/reference [--full gpt2_124m OUTDIR | --check-export DIR]

  (no arguments)             regenerate tests/reference/gpt2-tiny and tests/reference/llama-tiny
  --full gpt2_124m OUTDIR    GPT-2 124M's shape with B=4, T=64, into OUTDIR (large, not committed), then
                             whale's own check against it (build/tests/mpi_reference, or $WHALE_REFERENCE_TEST)
  --bench llama-small|gpt2-small
                             time transformers' training step on bench_workloads' shape of that name (one
                             thread, SGD with momentum, 2 warm-up steps then the median of 5), one JSON line
  --check-export DIR         load a model whale exported (DIR/config.json, DIR/model.safetensors) with
                             transformers' from_pretrained, run the reference batch (DIR/batch.safetensors)
                             and compare with whale's logits (DIR/whale_logits.f32); exit 1 past 1e-5
  -h, --help                 this text

Writes config.json, model.safetensors and reference.safetensors into each folder;
tests/reference/README.md describes them."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"scripts/reference: {message}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)

    def format_help(self):
        return USAGE + "\n"


def main(argv):
    parser = Parser(prog="scripts/reference", add_help=True)
    parser.add_argument("--full", nargs=2, metavar=("SHAPE", "OUTDIR"))
    parser.add_argument("--check-export", metavar="DIR")
    parser.add_argument("--bench", metavar="WORKLOAD")
    args = parser.parse_args(argv)
    if sum(bool(a) for a in (args.full, args.check_export, args.bench)) > 1:
        parser.error("--full, --check-export and --bench are separate runs")
    if args.bench and args.bench not in BENCH:
        parser.error(f"--bench: unknown workload '{args.bench}' (have: {', '.join(BENCH)})")

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    transformers.logging.set_verbosity_error()

    t0 = time.perf_counter()
    if args.bench:
        bench(args.bench)
        return
    if args.check_export:
        check_export(Path(args.check_export))
    elif args.full:
        shape, outdir = args.full
        if shape not in FULL:
            parser.error(f"--full: unknown shape '{shape}' (have: {', '.join(FULL)})")
        make, B, T, max_grad_norm = FULL[shape]
        generate(shape, make, B, T, max_grad_norm, Path(outdir))
        compare_full(Path(outdir))
    else:
        for label, (make, B, T, max_grad_norm) in TINY.items():
            generate(label, make, B, T, max_grad_norm, ROOT / "tests" / "reference" / label)
        # The README's layout notes, checked: plain numpy reads the files as they say.
        sys.path.insert(0, str(ROOT / "tests" / "reference"))
        import layout_check
        for label in TINY:
            diff = layout_check.check(ROOT / "tests" / "reference" / label)
            print(f"{label}: numpy forward from the README's layout notes within {diff:.1e} of the logits")
    print(f"scripts/reference: done in {time.perf_counter() - t0:.1f} s "
          f"(transformers {transformers.__version__}, torch {torch.__version__})")


if __name__ == "__main__":
    main(sys.argv[1:])
