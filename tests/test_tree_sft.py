"""TreeSFTTrainer against TRL's SFTTrainer (no packing) on the same batches: loss, every gradient, training steps,
for language-modelling and prompt-completion datasets whose rows share prefixes; padding-free batches; refusals."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from harts_hf import TreeSFTConfig, TreeSFTTrainer
from harts_hf.trainers.sft import forest_rows
from tests.trl_helpers import (
    assert_same_training,
    char_tokenizer,
    cpu_safe_trainer,
    save_tiny_model,
    worst_gradient_error,
)

BASE = dict(per_device_train_batch_size=6, learning_rate=1e-2, optim="sgd", bf16=False, use_cpu=True, report_to="none",
            logging_steps=1, save_strategy="no", seed=0, max_length=None)
SYSTEM = "you add numbers; answer with the sum only. "


def text_dataset():  # rows sharing a long system prefix and, pairwise, their question
    return Dataset.from_dict({"text": [f"{SYSTEM}{a}+{b}={a + b}" + (" done" if i % 2 else "") for i, (a, b) in
                                       enumerate([(1, 2), (1, 2), (3, 4), (3, 4), (15, 27), (8, 8)] * 2)]})


def completion_dataset():  # several completions of one prompt; the loss on completions only
    prompts = [f"{SYSTEM}{a}+{b}=" for a, b in [(1, 2), (3, 4), (15, 27)] for _ in range(4)]
    return Dataset.from_dict({"prompt": prompts, "completion": [f"{i}" * (1 + i % 3) for i in range(len(prompts))]})


def conversational_dataset():  # chat-formatted prompt-completion rows: a shared system turn, the loss on the answer
    system = {"role": "system", "content": SYSTEM}
    prompts = [[system, {"role": "user", "content": f"{a}+{b}="}] for a, b in [(1, 2), (3, 4), (5, 6)] for _ in range(4)]
    return Dataset.from_dict({"prompt": prompts,
                              "completion": [[{"role": "assistant", "content": f"{i}"}] for i in range(len(prompts))]})


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next_sft"), "qwen3_next_moe", router_aux_loss_coef=0.01)


def make_trainers(path, tmp_path, dataset, tree_args=(), peft_config=None, **overrides):
    """SFTTrainer and TreeSFTTrainer on two copies of the model; ``peft_config``: a function returning a PEFT config
    for both (LoRA B set to the same random values in both, so the adapters act)."""
    tokenizer = char_tokenizer()
    args = dict(BASE, output_dir=str(tmp_path), **overrides)
    models = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for _ in range(2)]
    peft = (lambda: {}) if peft_config is None else (lambda: {"peft_config": peft_config()})
    base = cpu_safe_trainer(SFTTrainer(models[0], args=SFTConfig(**args), train_dataset=dataset,
                                       processing_class=tokenizer, **peft()))
    tree = TreeSFTTrainer(models[1], args=TreeSFTConfig(**dict(args, **dict(tree_args))), train_dataset=dataset,
                          processing_class=tokenizer, **peft())
    if peft_config is not None:
        generator = torch.Generator().manual_seed(1)
        for (name, a), (_, b) in zip(base.model.named_parameters(), tree.model.named_parameters()):
            if "lora_B" in name:
                value = 0.1 * torch.randn(a.shape, generator=generator)
                a.data.copy_(value)
                b.data.copy_(value)
    return base, tree


def first_batch(trainer):
    trainer.model.train()
    torch.manual_seed(0)  # the same row shuffle for both trainers
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def assert_same_loss_and_grads(base, tree, num_items_in_batch=None, tol=1e-5):
    inputs_base, inputs_tree = first_batch(base), first_batch(tree)
    if "position_ids" not in inputs_tree:  # the same padded batch (padding-free: the same rows, concatenated)
        torch.testing.assert_close(inputs_tree["input_ids"], inputs_base["input_ids"])
    loss_base = base.compute_loss(base.model, inputs_base, num_items_in_batch=num_items_in_batch)
    loss_tree = tree.compute_loss(tree.model, inputs_tree, num_items_in_batch=num_items_in_batch)
    torch.testing.assert_close(loss_tree, loss_base, rtol=tol, atol=tol)
    loss_base.backward()
    loss_tree.backward()
    worst_gradient_error(base.model, tree.model, 100 * tol)
    for metric in ("entropy", "mean_token_accuracy"):  # SFTTrainer's metrics of the batch, logged by both
        assert tree._metrics["train"][metric][-1] == pytest.approx(base._metrics["train"][metric][-1], rel=tol), metric
    return inputs_tree


@pytest.mark.parametrize("dataset", [text_dataset, completion_dataset, conversational_dataset],
                         ids=["language_modeling", "prompt_completion", "conversational"])
@pytest.mark.parametrize("options, tree_only", [({}, {}), (dict(loss_type="dft"), {}), ({}, dict(padding_free=True))],
                         ids=["nll", "dft", "padding_free"])
def test_loss_and_gradients_match_sft_trainer(saved_model, tmp_path, dataset, options, tree_only):
    """padding_free: the tree trainer gets padding-free rows (position_ids restarting per row), SFTTrainer padded ones
    (transformers' Qwen3-Next cannot keep packed rows apart on the CPU)."""
    base, tree = make_trainers(saved_model, tmp_path, dataset(), tree_args=tree_only, **options)
    inputs = assert_same_loss_and_grads(base, tree)
    rows, masks = forest_rows(inputs)
    from harts_hf.trees import PrefixForest

    stats = PrefixForest.from_sequences(rows).pack().stats()
    assert stats["R_tok"] > 1.5  # the rows share their system prefix: the forest computes it once
    assert sum(int(m.sum()) for m in masks) > 0


def test_num_items_in_batch_normalisation(saved_model, tmp_path):
    base, tree = make_trainers(saved_model, tmp_path, completion_dataset())
    for trainer in (base, tree):  # set by the training loop: the aux loss is averaged over accumulation steps
        trainer.current_gradient_accumulation_steps = 2
    assert_same_loss_and_grads(base, tree, num_items_in_batch=torch.tensor(37))


def test_training_steps_give_the_same_parameters(saved_model, tmp_path):
    base, tree = make_trainers(saved_model, tmp_path, text_dataset(), max_steps=2, per_device_train_batch_size=3,
                               gradient_accumulation_steps=2)
    assert_same_training(base, tree)
    logged = [entry for entry in tree.state.log_history if "tree/R_tok" in entry]
    assert logged and logged[0]["tree/R_tok"] > 1


@pytest.mark.parametrize("fields, words", [
    (dict(label_smoothing_factor=0.1), ["label_smoothing_factor=0.1", "use_tree=False"]),
    (dict(tree_gdn_backend="cuda"), ["tree_gdn_backend"]),
    (dict(tree_head_chunk_size=0), ["tree_head_chunk_size"]),
])
def test_contradictory_config_is_refused(tmp_path, fields, words):
    with pytest.raises((ValueError, TypeError)) as info:
        TreeSFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **fields)
    for word in words:
        assert word in str(info.value)


def test_rewritten_labels_are_refused():
    inputs = {"input_ids": torch.tensor([[3, 4, 5]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
              "labels": torch.tensor([[4, 5, -100]])}
    with pytest.raises(ValueError, match="labels differ from input_ids"):
        forest_rows(inputs)


def test_token_accuracy_matches_sft_trainer(saved_model, tmp_path):
    """mean_token_accuracy (the label is its distribution's argmax) in tree mode: SFTTrainer's value. The LM head is
    set so that the space character wins wherever the final hidden row leans toward the batch's mean row, so the
    accuracy is neither 0 nor 1 (a random tiny model predicts no label)."""
    base, tree = make_trainers(saved_model, tmp_path, text_dataset())
    inputs = first_batch(base)
    space = base.processing_class.convert_tokens_to_ids(" ")
    with torch.no_grad():
        hidden = base.model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
        mean = hidden[inputs["attention_mask"].bool()].mean(0)
        for model in (base.model, tree.model):
            model.lm_head.weight.zero_()
            model.lm_head.weight[space] = 10 * mean / mean.square().sum()
    assert_same_loss_and_grads(base, tree)
    assert 0 < tree._metrics["train"]["mean_token_accuracy"][-1] < 1


def test_lora_matches_sft_trainer(saved_model, tmp_path):
    """PEFT LoRA (``peft_config``) on the Gated DeltaNet and attention projections: SFTTrainer's loss and adapter
    gradients, and two training steps to the same adapters."""
    from tests.test_tree_grpo import lora_config

    base, tree = make_trainers(saved_model, tmp_path, completion_dataset(), peft_config=lora_config)
    assert type(tree.model).__name__ == "PeftModel"
    assert_same_loss_and_grads(base, tree)
    assert all("lora_" in name for name, p in tree.model.named_parameters() if p.grad is not None)
    base, tree = make_trainers(saved_model, tmp_path, text_dataset(), peft_config=lora_config, max_steps=2,
                               per_device_train_batch_size=3, gradient_accumulation_steps=2)
    assert_same_training(base, tree)


GENERATION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ message['content'] }}"
    "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def multi_turn_dataset():  # conversations growing turn by turn: each row's earlier turns are another row's prefix
    system = {"role": "system", "content": SYSTEM}
    rows = []
    for a, b in [(1, 2), (3, 4), (15, 27)]:
        turns = [system, {"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": f"{a + b}"}]
        rows.append(list(turns))
        turns += [{"role": "user", "content": "times 2?"}, {"role": "assistant", "content": f"{2 * (a + b)}"}]
        rows.append(list(turns))
    return Dataset.from_dict({"messages": rows})


def test_assistant_only_loss_matches_sft_trainer(saved_model, tmp_path):
    """assistant_only_loss=True with a chat template that marks the assistant's text ({% generation %}): the loss
    on the assistant turns only, over multi-turn conversations that share their earlier turns."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = GENERATION_TEMPLATE
    args = dict(BASE, output_dir=str(tmp_path), assistant_only_loss=True)
    models = [AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32) for _ in range(2)]
    base = cpu_safe_trainer(SFTTrainer(models[0], args=SFTConfig(**args), train_dataset=multi_turn_dataset(),
                                       processing_class=tokenizer))
    tree = TreeSFTTrainer(models[1], args=TreeSFTConfig(**args), train_dataset=multi_turn_dataset(),
                          processing_class=tokenizer)
    inputs = assert_same_loss_and_grads(base, tree)
    rows, masks = forest_rows(inputs)
    carried = sum(int(m.sum()) for m in masks)
    assert 0 < carried < sum(map(len, rows)) / 4  # the assistants' answers only
