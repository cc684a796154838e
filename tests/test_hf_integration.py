"""Hugging Face Trainer and Accelerate driving offload_adam, on a tiny Llama built
from a config (nothing downloaded), on the CPU.

Optional dependencies (pinned in scripts/run_tests.sh, which installs them):
each test skips with the reason when transformers or accelerate is missing.
fp32 models are compared with torch.optim.AdamW driven the same way (equal to
fp32 rounding); bf16 models check that a run saved and resumed is bitwise the
uninterrupted one.
"""
import contextlib
import os

import pytest
import torch

import offload_adam

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (optional; scripts/run_tests.sh installs it)")
accelerate = pytest.importorskip(
    "accelerate", reason="accelerate is not installed (optional; scripts/run_tests.sh installs it)")

LR, CLIP, ACCUMULATE, STEPS = 1e-2, 0.5, 2, 6


def tiny_llama(dtype=torch.float32, layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config).to(dtype)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=48):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (n, 12), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS))


def max_rel(a, b):
    diff = max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))
    return diff / max(y.double().abs().max().item() for y in b)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def opt_state(opt, model):
    return [opt.state[p][k].clone() for p in model.parameters() for k in sorted(opt.state[p])]


def bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- Trainer -------------------------------------------------------------------------

def trainer_args(out, save_strategy="steps", accumulate=ACCUMULATE, max_grad_norm=CLIP):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=accumulate,
        max_steps=STEPS, max_grad_norm=max_grad_norm, learning_rate=LR, weight_decay=0.1,
        save_strategy=save_strategy, save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, disable_tqdm=True)


def train(tmp_path, name, dtype=torch.float32, optimizer=None, resume=None, **trainer_kw):
    model = tiny_llama(dtype)
    if optimizer is not None:
        opt = optimizer(model.parameters(), lr=LR, weight_decay=0.1)
        trainer_kw["optimizers"] = (opt, schedule(opt))
    trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path / name),
                                   train_dataset=Tokens(), **trainer_kw)
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def test_trainer_with_our_optimizer_matches_torch_adamw(tmp_path):
    # Trainer(optimizers=(opt, scheduler)), with clipping and accumulation.
    ours, t1 = train(tmp_path, "ours", optimizer=offload_adam.AdamW)
    theirs, t2 = train(tmp_path, "theirs", optimizer=torch.optim.AdamW)
    norms = [h["grad_norm"] for h in t2.state.log_history if "grad_norm" in h]
    assert max(norms) > CLIP   # the clip clipped
    assert max_rel(params_of(ours), params_of(theirs)) < 1e-5
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (t1, t2)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_trainer_optimizer_cls_and_kwargs(tmp_path):
    kwargs = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8}
    ours, t1 = train(tmp_path, "ours", optimizer_cls_and_kwargs=(offload_adam.AdamW, kwargs))
    theirs, _ = train(tmp_path, "theirs", optimizer_cls_and_kwargs=(torch.optim.AdamW, kwargs))
    opt = t1.optimizer.optimizer   # inside Accelerate's wrapper
    assert isinstance(opt, offload_adam.AdamW)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]   # Trainer's groups
    assert max_rel(params_of(ours), params_of(theirs)) < 1e-5


def test_trainer_resume_from_checkpoint_is_bitwise(tmp_path):
    full, t1 = train(tmp_path, "full", dtype=torch.bfloat16, optimizer=offload_adam.AdamW)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed, t2 = train(tmp_path, "resumed", dtype=torch.bfloat16, optimizer=offload_adam.AdamW,
                        resume=str(checkpoint))
    assert t2.state.global_step == STEPS
    assert bitwise(params_of(full), params_of(resumed))
    assert bitwise(opt_state(t1.optimizer.optimizer, full), opt_state(t2.optimizer.optimizer, resumed))


def test_trainer_with_a_frozen_layer_through_the_engine(tmp_path):
    # A bf16 model with a frozen embedding, its optimizer built over
    # model.parameters() on the offload engine (the path of CUDA params; here on
    # the simulated device, which checks the engine's ordering): trains like the
    # in-place run, bit for bit.
    from offload_adam.testing import AsyncSimDevice, simulated

    def run(sim):
        model = tiny_llama(torch.bfloat16)
        model.model.embed_tokens.weight.requires_grad_(False)
        with simulated(sim) if sim is not None else contextlib.nullcontext():
            opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        trainer = transformers.Trainer(
            model=model, args=trainer_args(tmp_path / str(sim is None), save_strategy="no"),
            train_dataset=Tokens(), optimizers=(opt, schedule(opt)))
        with sim.watch() if sim is not None else contextlib.nullcontext():
            trainer.train()
        return model, opt

    inplace, _ = run(None)
    sim = AsyncSimDevice(seed=0)
    try:
        engine, opt = run(sim)
        sim.check()
    finally:
        sim.close()
    assert opt.last_step_profile is not None   # the engine stepped it (in place: None)
    assert bitwise(params_of(inplace), params_of(engine))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_clips_freed_grads(tmp_path, accumulate):
    # free_grads_after_copy=True frees each grad in backward: Trainer's own
    # clipping and grad-norm logging (max_grad_norm in TrainingArguments,
    # through Accelerate and torch.nn.utils.clip_grad_norm_) would find no
    # grads, log grad_norm 0.0 and clip nothing. The freed grads answer the norm
    # from their host copies and the clip is applied inside the step, each
    # clipped grad rounded to bf16 as Trainer's multiplication rounds the kept
    # ones: the same norms as with the grads kept and, with them, the same
    # training bit for bit (the norms can differ: options.py, free_grads_after_copy).
    # accumulate=2: the second micro-batch's grads are added to the freed grads' host
    # copies (free_grads_after_copy accumulates on the host).
    def run(name, **options):
        model = tiny_llama(torch.bfloat16)
        opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **options)
        args = trainer_args(tmp_path / name, save_strategy="no", accumulate=accumulate)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                       optimizers=(opt, schedule(opt)))
        trainer.train()
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        return model, norms

    freed, freed_norms = run("freed", free_grads_after_copy=True)
    kept, kept_norms = run("kept")
    assert len(freed_norms) == STEPS and max(kept_norms) > CLIP   # the clip clipped
    assert freed_norms == kept_norms
    assert bitwise(params_of(freed), params_of(kept))


def test_trainer_streamed_llama_trains_saves_and_resumes_like_resident(tmp_path):
    """Issue 27: transformers' own Llama with its decoder layers streamed
    (stream_params) on the simulated device, trained by Trainer with accumulation,
    clipping and a schedule, a checkpoint saved at step 3: bit for bit the run with every
    param resident, the saved checkpoint holds the real weights, and resuming from it
    (a new streamed model) is bit for bit the uninterrupted run."""
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from offload_adam.testing import AsyncSimDevice, simulated

    class Settle(transformers.TrainerCallback):
        """Lets the simulated device's copies land before Trainer saves: safetensors
        reads a CPU tensor's bytes without an aten op, which the device cannot see
        (on a GPU the read is a copy ordered on the stream)."""

        def on_step_end(self, args, state, control, **kw):
            sim.settle()

    def run(name, streamed, resume=None):
        nonlocal sim
        sim = AsyncSimDevice(seed=0)
        try:
            model = tiny_llama(torch.bfloat16, layers=4)
            with simulated(sim):
                if streamed:
                    offload_adam.stream_params(model, LlamaDecoderLayer, prefetch=1)
                opt = offload_adam.AdamW(model.parameters(), lr=LR, weight_decay=0.1, bucket_mb=0.01)
            trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path / name),
                                           train_dataset=Tokens(), optimizers=(opt, schedule(opt)),
                                           callbacks=[Settle()])
            with sim.watch():
                trainer.train(resume_from_checkpoint=resume)
            sim.check()
        finally:
            sim.close()
        values = {k: v.clone() for k, v in model.state_dict().items()}
        return values, opt_state(opt, model), trainer

    sim = None
    resident, resident_state, _ = run("resident", False)
    streamed, streamed_state, t = run("streamed", True)
    assert resident.keys() == streamed.keys()
    assert all(torch.equal(resident[k], streamed[k]) for k in resident)
    assert bitwise(resident_state, streamed_state)
    saved = [load_file(str(tmp_path / name / "checkpoint-3" / "model.safetensors"))
             for name in ("resident", "streamed")]
    assert saved[0].keys() == saved[1].keys() and len(saved[0]) > 20
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    resumed, resumed_state, t2 = run("resumed", True, resume=str(tmp_path / "streamed" / "checkpoint-3"))
    assert t2.state.global_step == STEPS
    assert all(torch.equal(resumed[k], streamed[k]) for k in streamed)
    assert bitwise(resumed_state, streamed_state)


# ---- Accelerate -----------------------------------------------------------------------

def accelerate_run(optimizer, dtype=torch.float32, state_dir=None, resume=False):
    """Accelerate's loop: prepare, accumulate, clip_grad_norm_, step, for STEPS
    steps; save_state(state_dir) after step 3, or (resume) load_state(state_dir)
    first and run the steps after 3 on the batches after them."""
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = tiny_llama(dtype)
    opt = optimizer(model.parameters(), lr=LR, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, schedule(opt))
    step, norms = 0, []
    if resume:
        acc.load_state(state_dir)
        step = 3
        loader = acc.skip_first_batches(loader, step * ACCUMULATE)
    for batch in loader:
        with acc.accumulate(model):
            acc.backward(model(**batch).loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            step += 1
            if step == 3 and state_dir is not None and not resume:
                acc.save_state(state_dir)
            if step == STEPS:
                break
    return acc.unwrap_model(model), opt.optimizer, norms


def test_accelerate_prepare_accumulate_clip_matches_torch_adamw():
    ours, _, norms = accelerate_run(offload_adam.AdamW)
    theirs, _, _ = accelerate_run(torch.optim.AdamW)
    assert max(norms) > CLIP
    assert max_rel(params_of(ours), params_of(theirs)) < 1e-5


def test_accelerate_save_state_load_state_is_bitwise(tmp_path):
    state_dir = str(tmp_path / "state")
    full, fopt, _ = accelerate_run(offload_adam.AdamW, torch.bfloat16, state_dir)
    assert os.listdir(state_dir)
    resumed, ropt, _ = accelerate_run(offload_adam.AdamW, torch.bfloat16, state_dir, resume=True)
    assert bitwise(params_of(full), params_of(resumed))
    assert bitwise(opt_state(fopt, full), opt_state(ropt, resumed))


def test_trainer_resume_from_checkpoint_with_state_dirs(tmp_path):
    """Issue 25 item 6: Trainer builds the optimizer (optimizer_cls_and_kwargs) after it
    loaded checkpoint-3's model. With state_resume=True on the run's state files (at step
    6) that would set the params to step 6 and load step 3's moments over them: refused
    with a clear error, naming the way that works. That way (the checkpoint's model and
    optimizer state, the optimizer on directories without state) resumes bitwise the
    uninterrupted run: the same params and losses."""
    from offload_adam.nvme import manifest
    def run(name, state_dir, resume=None, **extra):
        kwargs = {"lr": LR, "state_dirs": str(state_dir), "bucket_mb": 0.01, **extra}
        model = tiny_llama(torch.bfloat16)
        trainer = transformers.Trainer(
            model=model, args=trainer_args(tmp_path / name), train_dataset=Tokens(),
            optimizer_cls_and_kwargs=(offload_adam.AdamW, kwargs))
        trainer.train(resume_from_checkpoint=resume)
        trainer.optimizer.optimizer.close()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return model, trainer.optimizer.optimizer, losses

    for d in ("d", "fresh"):
        (tmp_path / d).mkdir()
    full, fopt, full_losses = run("full", tmp_path / "d")
    checkpoint = str(tmp_path / "full" / "checkpoint-3")
    with pytest.raises(ValueError, match=r"state_resume=True set the params to the state files' "
                                         r"step 6 .* build the optimizer without state_resume "
                                         r"on directories without state"):
        run("again", tmp_path / "d", resume=checkpoint, state_resume=True)
    # the files still hold step 6 (Accelerate loads the optimizer's own state dict into it
    # once, which writes the same state again)
    assert manifest.read(str(tmp_path / "d"))["step"] == STEPS
    with pytest.raises(ValueError, match=r"already hold this optimizer's state at step 6.*"
                                         r"from a checkpoint of your own .* remove its files"):
        run("again", tmp_path / "d", resume=checkpoint)   # not state_resume for a checkpoint
    resumed, ropt, losses = run("resumed", tmp_path / "fresh", resume=checkpoint)
    assert bitwise(params_of(full), params_of(resumed))
    assert losses == full_losses   # (steps 1-3 from the checkpoint's log, 4-6 trained)
    assert ropt.step_count == fopt.step_count == STEPS


def test_trainer_given_a_resumed_optimizer_and_an_older_checkpoint_says_what_works(tmp_path):
    """Trainer(optimizers=(opt, ...)) with opt on state files at step 6 (state_resume=True)
    and resume_from_checkpoint of step 3: refused (Accelerate's prepare reads
    opt.state_dict() before the checkpoint's optimizer state is loaded, so "load it
    before stepping" cannot be done there), naming the way that works under Trainer."""
    from offload_adam.nvme import manifest

    def trainer(state_resume):
        model = tiny_llama(torch.bfloat16)
        opt = offload_adam.AdamW(model.parameters(), lr=LR, state_dirs=str(tmp_path / "d"),
                                 state_resume=state_resume, bucket_mb=0.01)
        return opt, transformers.Trainer(model=model, args=trainer_args(tmp_path / "out"),
                                         train_dataset=Tokens(), optimizers=(opt, schedule(opt)))
    (tmp_path / "d").mkdir()
    opt, t = trainer(False)
    t.train()
    opt.close()
    opt, t = trainer(True)
    with pytest.raises(RuntimeError, match=r"not the params of any step the files hold.*"
                                           r"Trainer's resume_from_checkpoint.*without "
                                           r"state_resume, on directories without state"):
        t.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    opt.close()
    assert manifest.read(str(tmp_path / "d"))["step"] == STEPS   # nothing written


@pytest.mark.parametrize("reentrant", [True, False])
def test_streamed_llama_with_hf_checkpointing_and_generate(tmp_path, reentrant):
    """Issue 27: transformers' own activation checkpointing (gradient_checkpointing_enable,
    reentrant or not) on a streamed Llama trains bit for bit like the resident model, and
    generate() (forwards without grad, with the KV cache) gives the same tokens."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from offload_adam.testing import AsyncSimDevice, simulated

    def run(streamed):
        sim = AsyncSimDevice(seed=1)
        try:
            model = tiny_llama(torch.bfloat16, layers=4)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            model.train()
            with simulated(sim), sim.watch():
                if streamed:
                    offload_adam.stream_params(model, LlamaDecoderLayer, prefetch=1)
                opt = offload_adam.AdamW(model.parameters(), lr=LR, bucket_mb=0.01)
                data = Tokens(8)
                for step in range(3):
                    for micro in range(2):
                        batch = data[2 * step + micro]
                        model(input_ids=batch["input_ids"][None],
                              labels=batch["labels"][None]).loss.backward()
                    opt.step()
                    opt.zero_grad()
                model.eval()
                with torch.no_grad():
                    tokens = model.generate(data[0]["input_ids"][None, :4], max_new_tokens=6,
                                            do_sample=False)
            sim.check()
        finally:
            sim.close()
        return {k: v.clone() for k, v in model.state_dict().items()}, tokens

    resident, resident_tokens = run(False)
    streamed, streamed_tokens = run(True)
    assert all(torch.equal(resident[k], streamed[k]) for k in resident)
    assert torch.equal(resident_tokens, streamed_tokens) and resident_tokens.shape[1] == 10
