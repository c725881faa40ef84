"""In-code pieces for TRL trainer tests: a character tokenizer with a chat template, a saved tiny model,
a prompt dataset, and a deterministic ``generate`` that yields branching completion groups."""

import random
from collections import defaultdict

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.,:!<>()[]{}\"'\n_")
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + CHARS + ["<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>", additional_special_tokens=SPECIAL[1:2])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompt_dataset(n: int = 16, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    prompts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


def length_reward(completions, **kwargs):
    """A verifiable toy reward with spread inside every group: 1 for even length, else the digit share."""
    return [1.0 if len(c) % 2 == 0 else sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def branching_completions(prompt: tuple, k: int, eos: int, low: int, high: int, width: int = 24) -> list[int]:
    """The k-th completion of a prompt: k=0,1 identical; k=2 a prefix of them; k=3 EOS only (empty);
    later ones fork off the shared draft at random depths (so groups form real trees)."""
    rng = random.Random(hash(prompt) % (2**31))
    draft = [rng.randrange(low, high) for _ in range(width)]
    if k in (0, 1):
        return draft + [eos]
    if k == 2:
        return draft[:5] + [eos]
    if k == 3:
        return [eos]
    branch = random.Random(hash((prompt, k)) % (2**31))
    cut = branch.randint(1, width - 1)
    return draft[:cut] + [branch.randrange(low, high) for _ in range(branch.randint(1, 8))] + [eos]


def patch_generate(model, tokenizer, draft_width=lambda prompt: 24):
    """Replace ``model.generate`` by the deterministic :func:`branching_completions` (per prompt group);
    ``draft_width(prompt)`` sets each prompt's draft length (uneven forests when it varies)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    low, high = len(SPECIAL), len(SPECIAL) + len(CHARS)

    def generate(input_ids=None, attention_mask=None, **kwargs):
        seen = defaultdict(int)
        completions = []
        for row, mask in zip(input_ids, attention_mask):
            prompt = tuple(row[mask.bool()].tolist())
            completions.append(branching_completions(prompt, seen[prompt], eos, low, high, width=draft_width(prompt)))
            seen[prompt] += 1
        width = max(len(c) for c in completions)
        padded = torch.tensor([c + [pad] * (width - len(c)) for c in completions], device=input_ids.device)
        return torch.cat([input_ids, padded], dim=1)

    model.generate = generate
    return model


def worst_gradient_error(base_model, tree_model, bound: float) -> float:
    """Largest relative gradient error over parameters (asserting each is below ``bound`` and that both models
    have gradients for the same parameters). A gradient under 1e-5 of the largest one is measured against that
    floor (a key projection's bias has gradient zero in exact arithmetic: its own norm is rounding)."""
    worst = 0.0
    floor = 1e-5 * max((p.grad.norm() for p in base_model.parameters() if p.grad is not None), default=0.0)
    for (name, a), (_, b) in zip(base_model.named_parameters(), tree_model.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is None or a.grad.norm() == 0:
            continue
        error = ((a.grad - b.grad).norm() / max(a.grad.norm(), floor)).item()
        worst = max(worst, error)
        assert error < bound, f"{name}: relative gradient error {error:.2e}"
    return worst


def save_tiny_model(path, family: str, router_aux_loss_coef: float) -> str:
    """Save a tiny model of ``family`` (tests/models.py) and the character tokenizer to ``path`` (TRL builds the
    reference model from the policy's path); returns the path as a string."""
    from tests.models import build

    model = build(family)
    model.config.router_aux_loss_coef = router_aux_loss_coef
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def cpu_safe_trainer(trainer):
    """A GRPOTrainer (or SFTTrainer) whose policy and reference models run their CPU forwards on transformers'
    PyTorch kernels where transformers bound fla's Triton kernels (triton installed); the tree trainers do this
    themselves."""
    from harts_hf.model_patches import cpu_safe

    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            cpu_safe(model)
    return trainer



def assert_same_training(base, tree) -> None:
    """Train both trainers with the same seed; every parameter of ``tree`` ends where ``base``'s does, up to fp32
    noise on the parameter and on the step it took."""
    import torch

    start = {name: p.detach().clone() for name, p in base.model.named_parameters()}
    for trainer in (base, tree):
        torch.manual_seed(0)  # the same row shuffles in both runs
        trainer.train()
    for (name, a), (_, b) in zip(base.model.named_parameters(), tree.model.named_parameters()):
        step = (a.detach() - start[name]).norm()
        assert (b - a).norm() <= 1e-5 * a.norm() + 1e-3 * step, name


def record_executions(monkeypatch, module) -> list[dict]:
    """Replace ``module.execute_plan`` (a trainer module's) with one that also records each call's stats, the plan's
    unique token count and whether it trained (a ``loss_fn``); returns the list it appends to."""
    calls = []
    execute_plan = module.execute_plan

    def recording(model, the_plan, **kwargs):
        result = execute_plan(model, the_plan, **kwargs)
        calls.append(dict(result.stats, unique=the_plan.packed.num_tokens, training=kwargs.get("loss_fn") is not None))
        return result

    monkeypatch.setattr(module, "execute_plan", recording)
    return calls
