"""The mutations the suite must kill: for each feature a claim rests on, a one-line break of the
code and the test that fails on it. `python -m tests.mutations` applies each alone, runs its
tests, expects a failure and restores the file; `--list` prints the table, `--check` only checks
that every mutation still applies (its text is in its file exactly once), and names select some.

Mutations are applied in place, in this checkout: the training replicas and the kfp.local tasks
import the package from it (the editable install), so a copy elsewhere would test the
unmutated code. The script refuses to start on a checkout whose mutated files have changes, and
restores each file even when interrupted. Run it alone: anything else using the checkout while a
mutation is applied sees the broken code.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str  # the feature it deletes
    path: str  # the file, from the repository root
    old: str  # the text replaced: exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids (or -k expressions after a "::-k " marker) that must fail

    def apply(self) -> str:
        source = (ROOT / self.path).read_text()
        if source.count(self.old) != 1:
            raise SystemExit(f"{self.name}: {self.old!r} is in {self.path} {source.count(self.old)} times, not once")
        (ROOT / self.path).write_text(source.replace(self.old, self.new))
        return source


MUTATIONS = [
    # issue 41's nine survivors of the audit
    Mutation(
        "identity: warmup_steps and min_lr no longer part of the training identity",
        "components/identity.py",
        '    "profile_poll_steps",\n',
        '    "profile_poll_steps", "warmup_steps", "min_lr",\n',
        ("tests/train/test_identity.py",),
    ),
    Mutation(
        "interrupt: the CLI is no child subreaper (an orphan of the run outlives it)",
        "pipelines/interrupt.py",
        "    become_subreaper()\n",
        "    pass\n",
        ("tests/pipeline/test_interrupt.py::test_an_orphan_of_the_run_is_stopped_with_it",),
    ),
    Mutation(
        "retention: a quarantined version's parents no longer kept",
        "components/store/retention.py",
        "record = store.quarantined(Ref.parse(ref)) or {}",
        "record = {}",
        ("tests/test_retention.py::test_a_quarantined_versions_parents_are_still_kept",),
    ),
    Mutation(
        "replicas: a rank past its share of the val batches counts batch 0 again",
        "components/sharded_model.py",
        "out += [result] if mine else []",
        "out += [result]",
        (
            "tests/stages/test_replicas.py::test_three_ranks_on_one_node_reshard_the_two_rank_checkpoint_and_validate_it",
        ),
    ),
    Mutation(
        "preflight: the GEMM left out of the numerics battery",
        "components/preflight/numerics.py",
        'OPS = ("gemm", "sdpa",',
        'OPS = ("sdpa",',
        ("tests/preflight/test_preflight.py::test_a_device_one_ulp_off_in_gemm_is_named_by_the_numerics_battery",),
    ),
    Mutation(
        "rollback: the skipped window dropped from the checkpoint's metadata",
        "components/train/worker.py",
        '"skipped_samples": [list(w) for w in state.skip_windows],',
        '"skipped_samples": [],',
        ("tests/train/test_guards.py::test_a_spike_from_a_corrupted_window_rewinds_past_it_and_the_lineage_lists_it",),
    ),
    Mutation(
        "relaunch: an attempt no longer keeps off the nodes quarantined by the one before",
        "components/launcher.py",
        "            launch.exclude_nodes = tuple(sorted({*launch.exclude_nodes, *launch.quarantined()}))\n",
        "            pass\n",
        ("tests/train/test_hang.py::test_a_rank_stalled_in_an_all_reduce_is_named_with_its_node_and_the_collective",),
    ),
    Mutation(
        "sweep: eval.objective ignored (val_loss always)",
        "pipelines/sweep.py",
        "    name = cfg.eval.objective\n",
        '    name = "val_loss"\n',
        ("tests/pipeline/test_sweep_objective.py",),
    ),
    Mutation(
        "lease: Lease.check() never raises",
        "components/store/lease.py",
        "        if self.lost is not None:\n            raise self.lost\n",
        "        return\n",
        ("tests/train/test_lease_lost.py",),
    ),
    # issue 41's weak assertions
    Mutation(
        "fp8: the Float8Linear GEMMs replaced by the high-precision nn.Linear forward",
        "components/precision/fp8.py",
        "                m.register_forward_pre_hook(_cast_input_to_bf16)\n",
        "                m.forward = super(type(m), m).forward\n",
        ("tests/train/test_training.py::test_every_fp8_recipe_trains_on_one_process",),
    ),
    Mutation(
        "metrics: the exporter serves grad_norm as loss and loss as grad_norm",
        "components/train/prometheus.py",
        "            value = record.get(key)\n",
        '            value = record.get({"loss": "grad_norm", "grad_norm": "loss"}.get(key, key))\n',
        ("tests/train/test_observability.py::test_each_node_serves_its_ranks_metrics_over_http_while_training",),
    ),
    # issue 41's healing
    Mutation(
        "validate: a damaged stored model is not quarantined (the rerun hands it back)",
        "components/validate/checks.py",
        "        if not store.check(model.ref):",
        "        if not store.verify(model.ref):",
        (
            "tests/stages/test_validate_evaluate.py::test_a_damaged_stored_model_is_quarantined_and_the_rerun_exports_it_again",
        ),
    ),
    Mutation(
        "tokenize: a long document encoded whole (its memory grows with its length)",
        "components/tokenize/pack.py",
        "        parts = [text] if len(text) <= PIECE_CHARS else list(pieces(text))",
        "        parts = [text]",
        ("tests/tokenize/test_long_documents.py::test_a_long_line_tokenizes_in_under_2gib[16]",),
    ),
    Mutation(
        "tokenize: a shard the store lost is answered by the cache (no rerun token)",
        "components/tokenize/plan.py",
        '            item["rerun"] = uuid.uuid4().hex\n',
        "            pass\n",
        ("tests/pipeline/test_local_run.py::test_a_rerun_recomputes_what_the_store_lost_whatever_the_cache_holds",),
    ),
    Mutation(
        "tokenize: a plan committed anew (wiped store) keys its shard tasks as the lost one did",
        "components/tokenize/plan.py",
        '"index": index, "planned": planned}',
        '"index": index}',
        ("tests/tokenize/test_tokenize.py::test_plan_shards_and_merge_fan_out_under_kfp_local",),
    ),
    Mutation(
        "lease: a replica publishes the model although its driver lost the lease",
        "components/train/handback.py",
        "    check_held_by_launch(job.store, job.identity, job.spec.launch_id)\n",
        "",
        ("tests/train/test_lease_lost.py",),
    ),
    # docs/parallelism.md
    Mutation(
        "fsdp: the blocks not sharded one by one (the root only)",
        "components/parallel/apply.py",
        "            fully_shard(block, reshard_after_forward=dims.pp == 1, **kwargs)\n",
        "            pass\n",
        ("tests/train/test_training.py::test_fsdp_trains_the_same_weights_as_ddp",),
    ),
    Mutation(
        "fsdp: fp8 weights all-gathered in high precision",
        "components/precision/fp8.py",
        "            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)\n",
        "            pass\n",
        ("tests/test_benchmarks.py::test_the_sharded_gpu_cases_run_under_torchrun_and_fp8_is_all_gathered_in_fp8",),
    ),
    Mutation(
        "fsdp: gradients reduce-scattered on the last micro-batch only, whatever the sync setting",
        "components/parallel/apply.py",
        "        model.set_requires_gradient_sync(last or fsdp_every_microbatch)\n",
        "        model.set_requires_gradient_sync(last)\n",
        (
            "tests/train/test_parallel.py::"
            "test_fsdp_reduce_scatters_every_micro_batch_by_default_and_both_ways_give_the_reference_gradient",
        ),
    ),
    Mutation(
        "hsdp: FSDP2 over the shard dimension only (the replicas never all-reduce)",
        "components/parallel/apply.py",
        '        kwargs = {"mesh": mesh[names] if len(names) > 1 else mesh[names[0]]}\n',
        '        kwargs = {"mesh": mesh[names[-1]]}\n',
        ("tests/train/test_training.py::test_hsdp_2x2_on_two_nodes_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "hsdp: dp_replicate need not divide the data-parallel world",
        "components/config/rules.py",
        '            rules.append(("train.dp_replicate", dp % r == 0 and dp > r, why))\n',
        '            rules.append(("train.dp_replicate", dp > r, why))\n',
        ("tests/preflight/test_plan.py::test_hsdp_shards_within_a_node_and_all_reduces_across_nodes",),
    ),
    Mutation(
        "identity: dp_replicate part of the training identity (no resume under another layout)",
        "components/identity.py",
        '    "dp_replicate",  # HSDP\'s layout, as the world size\n',
        "",
        ("tests/train/test_identity.py::test_a_bookkeeping_setting_keeps_the_training_identity[dp_replicate]",),
    ),
    Mutation(
        "tp: the sampler sees the whole world (the tp peers read different samples)",
        "components/train/job.py",
        "    dp, dp_rank = dims.dp, dims.dp_rank(rank)\n",
        "    dp, dp_rank = world, rank\n",
        ("tests/train/test_training.py::test_tensor_parallel_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "tp: the blocks' Linears not split over the tp ranks",
        "components/parallel/tensor.py",
        "        parallelize_module(block, tp_mesh, _styles(per_block, block, float8, sp))\n",
        "        pass\n",
        ("tests/test_benchmarks.py::test_the_sharded_gpu_cases_run_under_torchrun_and_fp8_is_all_gathered_in_fp8",),
    ),
    Mutation(
        "tp: a degree that does not divide the heads or the FFN composes",
        "components/config/rules.py",
        '            rules.append(("train.tp", n % tp == 0, f"{tp} must divide model.{key}',
        '            rules.append(("train.tp", True, f"{tp} must divide model.{key}',
        (
            "tests/test_config.py::test_tensor_parallel_degrees_that_cannot_split_the_world_or_the_model_fail_at_compose",
        ),
    ),
    Mutation(
        "pp: fewer micro-batches than stages compose",
        "components/config/rules.py",
        '        ("train.grad_accum_steps", accum >= pp or (mbs * accum) % pp == 0,\n',
        '        ("train.grad_accum_steps", True,\n',
        ("tests/test_config.py::test_pipeline_degrees_that_cannot_fill_the_stages_fail_at_compose",),
    ),
    Mutation(
        "pp: DDP beside pipeline stages composes",
        "components/config/rules.py",
        'train.parallelism != "ddp" or world % (pp * tp) or world == pp * tp, why))\n',
        "True, why))\n",
        ("tests/test_config.py::test_pipeline_degrees_that_cannot_fill_the_stages_fail_at_compose",),
    ),
    Mutation(
        "pp: the step's loss averaged over every rank, not the last stage's",
        "components/train/worker.py",
        "    step_loss = loss_and_pending[0].double() / job.dims.loss_holders()  #",
        "    step_loss = loss_and_pending[0].double() / job.world  #",
        ("tests/train/test_pipeline.py::test_pipeline_schedules_train_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "pp x tp: the loss averaged over the last stage's data-parallel ranks only, not its tp ranks too",
        "components/parallel/dims.py",
        "        return self.dp * self.tp\n",
        "        return self.dp\n",
        ("tests/train/test_pipeline.py::test_pp_x_tp_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "pp x tp: each stage's Linears not split over its tp ranks",
        "components/parallel/apply.py",
        '            apply_tp(chunk, mesh["tp"], stage_sp)\n',
        "            pass\n",
        ("tests/train/test_pipeline.py::test_pp_x_tp_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "pp: a step with fewer micro-batches than stages not split into pp of them",
        "components/parallel/dims.py",
        "    return pp, mbs * accum // pp\n",
        "    return accum, mbs\n",
        ("tests/train/test_pipeline.py::test_pp_x_tp_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "pp: the step's loss summed over the pipeline micro-batches, not averaged",
        "components/parallel/pipeline.py",
        "        return torch.stack([local_loss(loss.detach()) for loss in losses]).mean()\n",
        "        return torch.stack([local_loss(loss.detach()) for loss in losses]).sum()\n",
        ("tests/train/test_pipeline.py::test_pp_x_tp_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "dims: a rank's data-parallel coordinate ignores its tp peers (they read different samples)",
        "components/parallel/dims.py",
        "        return (rank // self.tp) % self.dp\n",
        "        return rank % self.dp\n",
        ("tests/train/test_training.py::test_tensor_parallel_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "fp8: the family's output head converted to Float8Linear too",
        "components/precision/fp8.py",
        "        return linear and fqn != head and fp8_eligible_dims(",
        "        return linear and fp8_eligible_dims(",
        ("tests/train/test_training.py::test_fp8_tensor_parallel_splits_float8_linear_weights_over_tp",),
    ),
    Mutation(
        "layering: a module outside components/parallel/ divides the world by the degrees again",
        "components/prelaunch.py",
        "    dp = ParallelDims.of(train, cluster.nodes * cluster.procs_per_node).dp\n",
        "    dp = cluster.nodes * cluster.procs_per_node // (train.tp * train.pp)\n",
        ("tests/test_layout.py::test_only_parallel_dims_computes_a_parallel_size_or_rank",),
    ),
    Mutation(
        "layering: fp8 names Llama's head instead of asking the family",
        "components/precision/fp8.py",
        "module_filter(head_of(model))",
        'module_filter("lm_head")',
        ("tests/test_layout.py::test_only_the_model_families_name_their_module_paths",),
    ),
    Mutation(
        "selective checkpointing: blocks checkpointed whole (the per-op policy's context dropped)",
        "components/parallel/checkpointing.py",
        "checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)",
        "checkpoint_wrapper(block, preserve_rng_state=False)",
        (
            "tests/preflight/test_plan.py::test_planned_activations_match_what_autograd_saves",
            "tests/train/test_training.py::test_hsdp_2x2_on_two_nodes_trains_the_losses_and_weights_of_one_process",
        ),
    ),
    Mutation(
        "selective checkpointing: every matmul's output kept, not every other",
        "components/parallel/checkpointing.py",
        "        every_other = func == _aten.mm.default and matmuls % 2 == 0\n",
        "        every_other = False\n",
        ("tests/preflight/test_plan.py::test_planned_activations_match_what_autograd_saves",),
    ),
    Mutation(
        "pp x tp: a stage's embeddings, norm and head left off the tp mesh",
        "components/parallel/tensor.py",
        "if _holds(model, name)}\n",
        "if _holds(model, name) and not hasattr(model, 'parts')}\n",
        ("tests/train/test_pipeline.py::test_pp_x_tp_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "nonfinite: the embeddings ordered after the blocks in the forward",
        "components/models/llama.py",
        '        return (0, 0) if parts[:2] == ["model", "embed_tokens"]',
        '        return (3, 0) if parts[:2] == ["model", "embed_tokens"]',
        ("tests/train/test_units.py::test_the_llama_forward_order_names_the_earliest_culprit_of_every_ranks",),
    ),
    Mutation(
        "planner: selective checkpointing plans no recompute",
        "components/preflight/plan.py",
        "        return 2 * L * (h * kv + h * h + h * model.ffn_hidden_size * experts)\n",
        "        return 0.0\n",
        ("tests/train/test_units.py::test_planned_selective_recompute_flops_are_what_backward_does_again",),
    ),
    Mutation(
        "planner: selective's down partial sum planned split over tp, not whole",
        "components/preflight/plan.py",
        "            kept_bytes = tokens * (i * h + c * h + saved / tp)",
        "            kept_bytes = tokens * (i * h + (c * h + saved) / tp)",
        (
            "tests/preflight/test_plan.py::test_a_tensor_parallel_ranks_planned_weights_and_activations_are_what_a_live_rank_holds",
        ),
    ),
    Mutation(
        "pp: the gradient norm clipped per stage, not over every stage",
        "components/train/optim.py",
        "        dist.all_reduce(squares, group=pp_group)\n",
        "        pass\n",
        ("tests/train/test_pipeline.py::test_pipeline_schedules_train_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "pp: a non-finite step names rank 0's own culprit (a later stage's never gathered)",
        "components/train/nonfinite.py",
        "    return min(named)[2] if named else None\n",
        "    return mine\n",
        (
            "tests/train/test_pipeline.py::"
            "test_fp8_pipeline_names_a_later_stages_non_finite_module_and_every_stages_float8_linears",
        ),
    ),
    Mutation(
        "pp: the Float8Linear modules are rank 0's stages' only",
        "components/train/handback.py",
        "    if job.pipeline is None:\n",
        "    if True:\n",
        (
            "tests/train/test_pipeline.py::"
            "test_fp8_pipeline_names_a_later_stages_non_finite_module_and_every_stages_float8_linears",
        ),
    ),
    Mutation(
        "plan: 1F1B keeps every micro-batch in flight (not at most the stages')",
        "components/preflight/plan.py",
        "        return min(micro, pp - rank)\n",
        "        return micro\n",
        (
            "tests/preflight/test_plan.py::test_pipeline_plans_a_stage_per_rank_and_a_bubble_that_more_micro_batches_shrink",
        ),
    ),
    Mutation(
        "plan: no pipeline bubble",
        "components/preflight/plan.py",
        "        bubble = (micro_stages + pp - 1) / micro_stages if pp > 1 else 1.0  #",
        "        bubble = 1.0  #",
        (
            "tests/preflight/test_plan.py::test_pipeline_plans_a_stage_per_rank_and_a_bubble_that_more_micro_batches_shrink",
        ),
    ),
    Mutation(
        "plan: PP x FSDP holds gradient shards only when fsdp_sync_every_microbatch says so",
        "components/preflight/plan.py",
        "(not train.fsdp_sync_every_microbatch or train.pp > 1)",
        "(not train.fsdp_sync_every_microbatch)",
        (
            "tests/preflight/test_plan.py::"
            "test_under_pipeline_parallelism_fsdp_holds_unsharded_gradients_whatever_the_sync_setting",
        ),
    ),
    Mutation(
        "plan --search: the layouts that fit not ranked by step time",
        "components/preflight/plan_search.py",
        "    return sorted(fitting, key=lambda x: (x.plan.step_time_s or 0.0, x.plan.total_gb))\n",
        "    return fitting\n",
        (
            "tests/preflight/test_plan.py::"
            "test_plan_search_ranks_the_layouts_that_fit_by_step_time_and_keeps_the_global_batch",
        ),
    ),
    Mutation(
        "plan --search: layouts that break a compose rule are planned",
        "components/preflight/plan_search.py",
        "    return [changes for changes in found if not _breaks_a_rule(with_changes(cfg, changes))]\n",
        "    return found\n",
        (
            "tests/preflight/test_plan.py::"
            "test_plan_search_from_a_pipeline_config_lists_layouts_that_compose_at_its_global_batch",
        ),
    ),
    Mutation(
        "plan --search: no PP layouts but the configured one",
        "components/preflight/plan_search.py",
        "    spanning_nodes = {p for p in (2**i for i in range(1, c.nodes.bit_length())) if c.nodes % p == 0}\n",
        "    spanning_nodes = set()\n",
        (
            "tests/preflight/test_plan.py::"
            "test_plan_search_from_a_pipeline_config_lists_layouts_that_compose_at_its_global_batch",
        ),
    ),
    # docs/reliability.md (the fault table)
    Mutation(
        "resume: auto continues the oldest stored checkpoint, not the newest",
        "components/train/resume.py",
        "key=lambda sm: (sm[0], sm[1].created), reverse=True):",
        "key=lambda sm: (sm[0], sm[1].created), reverse=False):",
        ("tests/train/test_training.py::test_resume_auto_continues_from_the_store",),
    ),
    Mutation(
        "store: an unreachable store's error does not name the endpoint",
        "components/store/connection.py",
        'f"artifact store at {endpoint} unreachable: {what} failed',
        'f"artifact store unreachable: {what} failed',
        (
            "tests/test_store.py::test_unreachable_endpoint_fails_in_bounded_time_naming_it",
            "tests/chaos/test_faults.py::test_s3_outage_during_publish_then_recovery",
        ),
    ),
    Mutation(
        "store: retries run for 10x store.timeout_s",
        "components/store/connection.py",
        "        if elapsed + delay > timeout_s:\n",
        "        if elapsed + delay > 10 * timeout_s:\n",
        (
            "tests/test_store.py::test_unreachable_endpoint_fails_in_bounded_time_naming_it",
            "tests/chaos/test_faults.py::test_s3_outage_during_publish_then_recovery",
        ),
    ),
    Mutation(
        "store: a publish commits its manifest before the files (a half-written version is visible)",
        "components/store/artifacts.py",
        "        return self.commit(ref, self.upload(ref, files), metadata, parents)\n",
        "        return (self.commit(ref, {}, metadata, parents),"
        " self.commit(ref, self.upload(ref, files), metadata, parents))[1]\n",
        (
            "tests/chaos/test_faults.py::test_s3_outage_during_publish_then_recovery",
            "tests/test_store.py::test_interrupted_publish_leaves_no_version",
        ),
    ),
    Mutation(
        "checkpoint: a full disk's error names neither the directory nor the free space",
        "components/train/checkpoint.py",
        'f"checkpoint step-{step} could not be written to {self.root} ({free:.1f} MB free): "',
        'f"checkpoint step-{step} failed: "',
        ("tests/chaos/test_faults.py::test_full_checkpoint_disk_fails_clearly_and_keeps_earlier_checkpoints",),
    ),
    Mutation(
        "tokenize: invalid UTF-8 in a JSON column passed on to tokenization",
        "components/tokenize/documents.py",
        "        ds.data.table.column(cfg.text_field).validate(full=True)\n",
        "        pass\n",
        (
            "tests/chaos/test_hostile_input.py::test_invalid_utf8_in_a_dataset_is_a_clear_error",
            "tests/tokenize/test_tokenize.py::test_a_parse_error_names_the_file_the_line_and_the_reason[latin-1-jsonl]",
        ),
    ),
    Mutation(
        "tokenize: a line longer than data.max_doc_bytes no longer refused while streaming",
        "components/tokenize/sources.py",
        "                too_long = next((i for i, n in lengths.items() if n > max_doc_bytes), None)\n",
        "                too_long = None\n",
        ("tests/chaos/test_hostile_input.py::test_a_huge_single_line_is_refused_while_streaming[80MB]",),
    ),
    Mutation(
        "checkpoint: the metadata unpickler resolves any global",
        "components/checkpoint_format.py",
        "        if (module, name) in ALLOWED_GLOBALS or dtype:\n",
        "        if True:\n",
        ("tests/chaos/test_hostile_input.py::test_files_crafted_to_run_code_on_load_are_refused",),
    ),
    Mutation(
        "checkpoint: a rank's state unpickled with weights_only=False",
        "components/train/checkpoint.py",
        "    rank_state = torch.load(rank_file, weights_only=True) if",
        "    rank_state = torch.load(rank_file, weights_only=False) if",
        ("tests/chaos/test_hostile_input.py::test_files_crafted_to_run_code_on_load_are_refused",),
    ),
    Mutation(
        "hf: a model directory with pickled weights only goes to transformers",
        "components/hf.py",
        '    if not list(model_dir.glob("*.safetensors")):\n',
        "    if False:\n",
        ("tests/chaos/test_hostile_input.py::test_files_crafted_to_run_code_on_load_are_refused",),
    ),
    Mutation(
        "cli: a refused override prints its error over several lines",
        "pipelines/cli.py",
        "    return out or type(e).__name__\n",
        "    return text\n",
        (
            "tests/test_config.py::test_values_that_cannot_work_fail_at_compose_naming_the_key",
            "tests/chaos/test_hostile_input.py::test_any_override_is_success_or_one_clear_line",
        ),
    ),
    Mutation(
        "store: a local key may leave the store root",
        "components/store/local.py",
        "    def _path(self, key: str) -> Path:\n",
        "    def _path(self, key: str) -> Path:\n        return self.root / key\n",
        ("tests/test_store.py::test_local_store_never_writes_outside_its_root",),
    ),
    Mutation(
        "credentials: the local Secret stand-in (the store's keys) left in the nodes' directory",
        "components/launcher.py",
        "            secret.unlink(missing_ok=True)\n",
        "            pass\n",
        ("tests/test_local_pod.py::test_each_node_has_its_own_directory_and_only_its_declared_environment",),
    ),
    Mutation(
        "lineage: a model no longer names the checkpoint it was exported from",
        "components/train/handback.py",
        'parents=[job.spec.dataset, f"checkpoint/{job.model_cfg.name}@{result.checkpoint_version}"],',
        "parents=[job.spec.dataset],",
        ("tests/stages/test_validate_evaluate.py::test_good_model_passes_every_check",),
    ),
    # the cluster guide and the CLI (issues 40, 42, 43)
    Mutation(
        "run: a model that cannot fit starts the pipeline (no plan before the first task)",
        "pipelines/commands.py",
        "        if refusal := plan_refusal(OmegaConf.to_object(cfg)):\n",
        "        if refusal := None:\n",
        ("tests/pipeline/test_local_run.py::test_a_model_that_cannot_fit_is_refused_before_any_task_runs",),
    ),
    Mutation(
        "render: data that cannot fill one step is sent to the cluster",
        "pipelines/cluster.py",
        "    if size is None or size // block >= per_step:",
        "    if size is None or size // block >= 0:",
        (
            "tests/pipeline/test_cluster.py::test_the_guides_first_submit_on_the_shipped_corpus_is_refused_before_any_kfp_call",
        ),
    ),
    Mutation(
        "submit: the client's caching overrides the compiled no-cache of preflight and the plan",
        "pipelines/cluster.py",
        "            enable_caching=None,",
        "            enable_caching=True,",
        ("tests/pipeline/test_kfp_client.py::test_submit_keeps_the_compiled_caching_of_each_task",),
    ),
    Mutation(
        "artifacts: rm removes a pinned version without --force",
        "components/store/deletion.py",
        "        if pinned and not force:",
        "        if False:",
        ("tests/test_artifacts_cli.py::test_rm_refuses_a_pinned_version_unless_forced",),
    ),
    # issue 43, point 1: preflight worth its time
    Mutation(
        "preflight: a local performance outlier quarantined again (outliers default to quarantine)",
        "components/preflight/verdict.py",
        'return cfg.outliers or ("warn" if local else "quarantine")',
        'return cfg.outliers or "quarantine"',
        (
            "tests/preflight/test_preflight.py::test_a_slow_simulated_node_is_warned_of_quarantines_nothing_and_training_keeps_its_nodes",
        ),
    ),
    Mutation(
        "preflight: stored measurements never reused (every run measures)",
        "components/preflight/stage.py",
        "    if max_age_min <= 0:\n        return None\n    versions",
        "    if max_age_min <= 1e9:\n        return None\n    versions",
        ("tests/pipeline/test_local_run.py::test_a_rerun_recomputes_what_the_store_lost_whatever_the_cache_holds",),
    ),
    Mutation(
        "preflight: a run with no step left measures the fleet anyway",
        "components/preflight/component.py",
        'if done := trained_to_the_end(ref, g["model"], g["train"], t.store, mixture):',
        "if done := None:",
        ("tests/pipeline/test_local_run.py::test_run_end_to_end_over_minio_traces_lineage_and_reuses_the_dataset",),
    ),
    # issue 42, point 2: `liftoff doctor`, one mutation a row, and its place in submit
    Mutation(
        "doctor: kfp backend: the healthz's version never read (any backend passes)",
        "pipelines/doctor.py",
        "    version = _call(lambda: kfp_features.backend_version(kfp_client), t.cfg)\n",
        '    version = "99.0.0"\n',
        ("tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[kfp-backend]",),
    ),
    Mutation(
        "doctor: pod security: the namespace's enforce label ignored (always privileged)",
        "pipelines/doctor.py",
        'enforced = labels.get(ENFORCE_LABEL, "privileged")',
        'enforced = "privileged"',
        ("tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[pod-security]",),
    ),
    Mutation(
        "doctor: volcano: a queue that is not Open passes",
        "pipelines/doctor.py",
        'if state != "Open":',
        "if False:",
        ("tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[volcano]",),
    ),
    Mutation(
        "doctor: gpu nodes: a node short of a resource still fits a replica",
        "pipelines/doctor.py",
        "        if have < amount:\n",
        "        if have < 0:\n",
        (
            "tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[gpu-nodes]",
            "tests/pipeline/test_doctor.py::test_the_gpu_nodes_row_names_why_each_node_does_not_fit",
        ),
    ),
    Mutation(
        "doctor: store conditional writes: a second If-None-Match create that succeeds goes unseen",
        "components/store/probe.py",
        "    if backend.put_bytes_if_absent(key, second):\n",
        "    if False:\n",
        (
            "tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[store-conditional-writes]",
        ),
    ),
    Mutation(
        "doctor: store capacity: a local store's free space never compared",
        "pipelines/doctor.py",
        "        if free < planned:\n",
        "        if False:\n",
        ("tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[store-capacity]",),
    ),
    Mutation(
        "doctor: image: a commit tag other than HEAD's passes",
        "pipelines/doctor.py",
        "    if not (head_commit.startswith(tag_commit) or tag_commit.startswith(head_commit)):\n",
        "    if False:\n",
        ("tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[image]",),
    ),
    Mutation(
        "doctor: submit and upload no longer run the doctor first",
        "pipelines/cluster.py",
        'if not skip_doctor and getattr(cfg.cluster.scheduler, "value", cfg.cluster.scheduler) == "kubernetes":',
        "if False:",
        ("tests/pipeline/test_doctor.py::test_submit_and_upload_refuse_an_unhealthy_cluster_before_any_kfp_call",),
    ),
    Mutation(
        "doctor: a run submitted with --skip-doctor is not named so",
        "pipelines/cluster.py",
        'suffix = DOCTOR_SKIPPED if skip_doctor else ""',
        'suffix = ""',
        ("tests/pipeline/test_doctor.py::test_skip_doctor_submits_and_the_run_name_says_so",),
    ),
    Mutation(
        "preflight: the inputs' check (data fit) left to train, which KFP retries",
        "components/preflight/component.py",
        "        check_inputs(",
        "        (lambda *a: None)(",
        (
            "tests/pipeline/test_local_run.py::test_data_that_cannot_fill_a_step_fails_in_preflight_which_kfp_never_retries",
        ),
    ),
    Mutation(
        "task exit: the teardown skipped even when the executor raised after the task",
        "components/task.py",
        "if not raised and Path(output).is_file():",
        "if Path(output).is_file():",
        ("tests/test_task_exit.py",),
    ),
    Mutation(
        "task exit: the teardown skipped before the outputs are written",
        "components/task.py",
        "if not raised and Path(output).is_file():",
        "if not raised:",
        ("tests/test_task_exit.py",),
    ),
    Mutation(
        "train: a launch told preflight was skipped trains the steps a damaged final checkpoint leaves",
        "components/train/worker.py",
        "    if job.spec.trains_no_step and (found is None or found.step < job.train.steps):",
        "    if False:",
        ("tests/train/test_resume.py::test_a_corrupted_stored_checkpoint_is_quarantined_and_the_rerun_heals_it",),
    ),
    Mutation(
        "preflight: NCCL's environment and the fabric out of the fleet key (TCP numbers reused after a fix)",
        "components/preflight/stage.py",
        '        "fabric": [\n            cluster.env,',
        '        "fabric": [\n            None,',
        (
            "tests/preflight/test_preflight.py::test_the_fleet_key_changes_with_what_is_measured_and_not_with_how_it_is_judged",
        ),
    ),
    Mutation(
        "train: the nodes left out no longer said in the train line",
        "components/train/component.py",
        'left_out = verdict.get("left_out", {})',
        "left_out = {}",
        ("tests/pipeline/test_local_run.py::test_a_rerun_recomputes_what_the_store_lost_whatever_the_cache_holds",),
    ),
    # issue 40, point 5: an honest plan on the CPU
    Mutation(
        "preflight: MFU computed against the measured throughput (82% on a CPU)",
        "components/preflight/plan.py",
        "        utilization = mfu(tps, fpt, peak_tflops, world)",
        "        utilization = mfu(tps, fpt, peak_tflops or tflops, world)",
        ("tests/pipeline/test_run_output.py::test_the_plan_times_the_step_within_2x_of_the_run_and_claims_no_mfu",),
    ),
    Mutation(
        "preflight: the step timed at bf16's GEMM speed whatever the precision (emulated fp8 is slower)",
        "components/preflight/stage.py",
        "    dtype = gemm_dtype(measured, precision)\n    attention =",
        '    dtype = "bf16"\n    attention =',
        ("tests/pipeline/test_run_output.py::test_the_plan_times_the_step_within_2x_of_the_run_and_claims_no_mfu",),
    ),
    Mutation(
        "sweep: a resumed Optuna study's sampler seeded as the first (it draws the first's points again)",
        "pipelines/sweep.py",
        'reseeded = [f"hydra.sweeper.sampler.seed={int(seed) + done}"] if seed is not None and done else []',
        "reseeded = []",
        ("tests/pipeline/test_sweep_objective.py",),
    ),
    Mutation(
        "doctor: nccl: a pattern selecting no HCA passes",
        "pipelines/doctor.py",
        "    if not used:\n        found = (",
        "    if False:\n        found = (",
        ("tests/pipeline/test_doctor.py::test_each_unhealthy_fact_alone_fails_its_row_in_one_line[nccl]",),
    ),
    Mutation(
        "preflight: a CPU's fp8 GEMM is the reference _scaled_mm, not the emulation training runs",
        "components/precision/fp8.py",
        '        torch.manual_seed(0)\n        if device.type != "cuda":',
        "        torch.manual_seed(0)\n        if False:",
        ("tests/preflight/test_preflight.py::test_on_a_cpu_the_fp8_gemm_preflight_times_is_the_one_training_runs",),
    ),
    Mutation(
        "sequence parallel: TP never runs it",
        "components/parallel/apply.py",
        '        sp = sequence_parallel(train, model.config.tie_word_embeddings, device.type == "cuda")',
        "        sp = False",
        (
            "tests/train/test_training.py::test_tensor_parallel_trains_the_losses_and_weights_of_one_process",
            "tests/preflight/test_plan.py::test_a_tensor_parallel_ranks_planned_weights_and_activations_are_what_a_live_rank_holds",
        ),
    ),
    Mutation(
        "loss-parallel head: the logits gathered whole",
        "components/parallel/tensor.py",
        "ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)",
        "ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False)",
        (
            "tests/preflight/test_plan.py::test_a_tensor_parallel_ranks_planned_weights_and_activations_are_what_a_live_rank_holds",
        ),
    ),
    Mutation(
        "planner: sequence parallel never planned",
        "components/preflight/plan.py",
        "    sp = sequence_parallel(train, model.tie_embeddings, cuda)\n",
        "    sp = False\n",
        (
            "tests/preflight/test_plan.py::test_torchtitans_published_70b_2d_row_plans_under_100_gb_with_sequence_parallel",
        ),
    ),
    Mutation(
        "moe: the router's aux loss never joins the loss",
        "components/train/job.py",
        "        loss = loss + term\n",
        "        loss = loss\n",
        (
            "tests/train/test_moe.py::test_the_router_aux_loss_is_in_the_gradient_and_a_model_trained_without_it_routes_differently",
        ),
    ),
    Mutation(
        "planner: a mixture of experts' FLOPs count every expert",
        "components/model_math.py",
        'return numel * cfg.experts_per_token / cfg.num_experts if kind == "expert" else numel',
        "return numel",
        (
            "tests/preflight/test_plan.py::test_the_planner_counts_every_expert_for_memory_and_the_routed_ones_for_flops",
        ),
    ),
    Mutation(
        "moe: the step record carries no expert load",
        "components/train/worker.py",
        '            **({"expert_load": [n / routed for n in expert_tokens]} if routed else {}),',
        "            **{},",
        ("tests/train/test_moe.py::test_a_mixture_of_experts_trains_under_fsdp_and_ddp_and_exports_a_plain_mixtral",),
    ),
    Mutation(
        "model.family is ignored: every config builds Llama",
        "components/models/__init__.py",
        "    return FAMILIES[cfg.family]",
        '    return FAMILIES["llama"]',
        (
            "tests/preflight/test_plan.py::test_the_planner_counts_every_expert_for_memory_and_the_routed_ones_for_flops",
        ),
    ),
    Mutation(
        "pp x tp: no sequence parallel inside pipeline stages",
        "components/parallel/apply.py",
        '    stage_sp = sequence_parallel(train, model.config.tie_word_embeddings, device.type == "cuda")\n',
        "    stage_sp = False\n",
        ("tests/train/test_pipeline.py::test_pp_x_tp_trains_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "pp x fsdp: a stage's blocks resharded after every micro-batch's forward (gathered again each)",
        "components/parallel/apply.py",
        "reshard_after_forward=dims.pp == 1",
        "reshard_after_forward=True",
        ("tests/train/test_pipeline.py::test_pipeline_schedules_train_the_losses_and_weights_of_one_process",),
    ),
    Mutation(
        "planner: FSDP's mixed-precision residual stream planned fp32, as autocast's",
        "components/precision/base.py",
        '        if not fsdp or self.compute_dtype == "float32":\n',
        "        if True:\n",
        (
            "tests/preflight/test_plan.py::test_under_fsdps_mixed_precision_a_rank_saves_and_peaks_at_what_the_plan_says",
        ),
    ),
    Mutation(
        "planner: the loss's transient gradients not counted at the peak",
        "components/preflight/plan.py",
        "    transient = loss_transient(model, train, seq_len, sp) if recompute and head_too else 0.0\n",
        "    transient = 0.0\n",
        ("tests/preflight/test_plan.py::test_planned_activations_match_what_autograd_saves",),
    ),
    Mutation(
        "planner: data-parallel communication added to compute, none hidden",
        "components/preflight/plan.py",
        "        exposed = waits + unhidden(data_parallel, compute, share.layers)\n",
        "        exposed = waits + data_parallel\n",
        (
            "tests/preflight/test_plan.py::test_fsdp_on_128_gpus_plans_the_published_few_percent_under_8_not_the_sum_of_its_traffic",
        ),
    ),
    Mutation(
        "planner: one efficiency for every precision recipe (fp8 planned at bf16's speed)",
        "components/devices.py",
        "    return base * RECIPE_RATIO[recipe_key(train)] * (1.0 if compiled else EAGER_RATIO)\n",
        "    return base\n",
        ("tests/test_benchmarks.py::test_the_planner_holds_to_torchtitans_published_rows",),
    ),
    Mutation(
        "planner: allocator headroom not counted (the tensors' bytes judged against the whole device)",
        "components/preflight/plan.py",
        "    return p.total_gb / (1 - headroom)\n",
        "    return p.total_gb\n",
        ("tests/test_benchmarks.py::test_the_planner_holds_to_torchtitans_published_rows",),
    ),
    Mutation(
        "loss: the cross-entropy over the whole micro-batch at once, whatever loss_chunk_tokens says",
        "components/models/__init__.py",
        "    if not chunk_tokens or isinstance(flat, DTensor) or flat.shape[0] <= chunk_tokens:\n",
        "    if True:\n",
        (
            "tests/preflight/test_plan.py::test_a_chunked_loss_trains_the_same_gradients_and_peaks_lower_where_the_plan_says",
        ),
    ),
    Mutation(
        "plan: the host's dispatch of a step is left out of a CPU step (GEMMs alone)",
        "components/preflight/plan.py",
        "    step = max(p.step_time_s, host_s) if cuda else p.step_time_s + host_s\n",
        "    step = max(p.step_time_s, host_s) if cuda else p.step_time_s\n",
        (
            "tests/preflight/test_preflight.py::test_the_host_step_preflight_times_dispatches_the_ops_of_the_runs_step_and_the_plan_counts_it",
        ),
    ),
    Mutation(
        "preflight: the host step's proxy runs without the run's precision recipe",
        "components/preflight/bench.py",
        "    precision.apply(net, train, device)\n",
        "",
        (
            "tests/preflight/test_preflight.py::test_the_host_step_preflight_times_dispatches_the_ops_of_the_runs_step_and_the_plan_counts_it",
        ),
    ),
    Mutation(
        "preflight: the host step's proxy runs one micro-batch whatever the run's accumulation",
        "components/preflight/bench.py",
        "    micro = pipeline_microbatches(train)[0]\n",
        "    micro = 1\n",
        (
            "tests/preflight/test_preflight.py::test_the_host_step_preflight_times_dispatches_the_ops_of_the_runs_step_and_the_plan_counts_it",
        ),
    ),
    Mutation(
        "preflight: the stage plans without the nodes' measured host step",
        "components/preflight/stage.py",
        "        host_s=host_s,\n",
        "",
        ("tests/preflight/test_preflight.py::test_two_node_preflight_measures_everything_and_passes",),
    ),
    Mutation(
        "step: the loss read back to the host every step (the queue drains on a GPU)",
        "components/train/worker.py",
        "    comm_s = time.perf_counter() - t_comm\n",
        "    loss_and_pending.tolist()\n    comm_s = time.perf_counter() - t_comm\n",
        (
            "tests/train/test_host_reads.py::test_a_plain_step_reads_nothing_back_and_a_settling_step_reads_once[bf16-ddp]",
        ),
    ),
    Mutation(
        "training: transformers builds the causal mask per forward (its packed-sequence check reads a value back)",
        "components/train/job.py",
        "    attend_causally(model)  # packed blocks: no mask, no host read per forward\n",
        "",
        (
            "tests/train/test_host_reads.py::test_a_plain_step_reads_nothing_back_and_a_settling_step_reads_once[fp8-fsdp]",
        ),
    ),
    Mutation(
        "profiler: it looks for a request between settling steps",
        "components/train/profiler.py",
        "            self._finish(step)\n\n    def settled(self, step: int) -> None:\n",
        "            self._finish(step)\n        self.settled(step)\n\n    def settled(self, step: int) -> None:\n",
        (
            "tests/train/test_host_reads.py::test_a_plain_step_reads_nothing_back_and_a_settling_step_reads_once[bf16-ddp]",
        ),
    ),
    Mutation(
        "guards: a spike under skip is applied (not masked on the device)",
        "components/train/guards.py",
        "            passed = passed & ~spike\n",
        "            passed = passed\n",
        (
            "tests/train/test_guards.py::test_the_device_guards_judge_against_the_recent_median_and_mask_the_optimizer_step",
        ),
    ),
    Mutation(
        "optimizer: the guards' decision does not mask the step",
        "components/train/optim.py",
        "    optimizer.found_inf = (~stepped).to(torch.float32)\n",
        "    optimizer.found_inf = torch.zeros_like(stepped, dtype=torch.float32)\n",
        (
            "tests/train/test_guards.py::test_the_device_guards_judge_against_the_recent_median_and_mask_the_optimizer_step",
        ),
    ),
    Mutation(
        "guards: the device's running median is the lower middle, not statistics.median",
        "components/train/guards.py",
        "        median = torch.nanquantile(ring, 0.5)  # statistics.median's: the two middles' mean\n",
        "        median = torch.nanmedian(ring)\n",
        (
            "tests/train/test_guards.py::test_the_device_guards_judge_against_the_recent_median_and_mask_the_optimizer_step",
        ),
    ),
    Mutation(
        "guards: every loss joins the device's ring, a skipped spike too",
        "components/train/guards.py",
        "        count += join.long()\n",
        "        count += 1\n",
        (
            "tests/train/test_guards.py::test_the_device_guards_judge_against_the_recent_median_and_mask_the_optimizer_step",
        ),
    ),
    Mutation(
        "planner: async TP's collectives wait in full, as plain TP's",
        "components/preflight/plan.py",
        "        waits += (tp_s / tp + max(tp_s - compute_s, 0.0)) if train.async_tp else tp_s\n",
        "        waits += tp_s\n",
        ("tests/test_benchmarks.py::test_the_planner_holds_to_torchtitans_published_rows",),
    ),
    Mutation(
        "planner: attention timed at the linear layers' rate (fp8's, where flash attention runs bf16)",
        "components/preflight/plan.py",
        "        per_token = (fpt + recompute - attention) / tflops + attention / attention_tflops\n",
        "        per_token = (fpt + recompute) / tflops\n",
        ("tests/test_benchmarks.py::test_the_planner_holds_to_torchtitans_published_rows",),
    ),
    Mutation(
        "config: async TP composes for a CPU run",
        "components/config/rules.py",
        '            rules.append(("train.async_tp", cluster.gpu > 0, why))\n',
        '            rules.append(("train.async_tp", True, why))\n',
        ("tests/test_config.py::test_async_tp_off_a_cuda_tp_run_fails_at_compose",),
    ),
    # issue 44: data mixtures
    Mutation(
        "mixture: the schedule ignores the weights (every source an equal share)",
        "components/train/data.py",
        "        ends = np.cumsum(self.weights)\n",
        "        ends = np.cumsum([1 / len(self.weights)] * len(self.weights))\n",
        ("tests/test_mixture.py::test_the_sampler_draws_each_source_by_its_weight_at_every_prefix",),
    ),
    Mutation(
        "mixture: a resumed sampler counts no draws before its position",
        "components/train/data.py",
        "        base = self._reading.before(start)\n",
        "        base = np.zeros(len(self._orders), dtype=np.int64)\n",
        ("tests/test_mixture.py::test_a_two_rank_run_resumed_on_one_rank_draws_the_blocks_of_the_uninterrupted_run",),
    ),
    Mutation(
        "mixture: a source's cap on passes never stops the sampler",
        "components/train/data.py",
        "        if cap is not None and n >= cap * self._orders[src].total:\n",
        "        if False:\n",
        ("tests/test_mixture.py::test_each_source_is_drawn_in_whole_passes_and_a_cap_stops_it",),
    ),
    Mutation(
        "mixture: the weights make the sources' dataset versions (a weight sweep tokenizes again)",
        "components/tokenize/plan.py",
        '        version = hashlib.sha256(f"{fp}:{shared.version}".encode()).hexdigest()[:16]\n',
        '        version = hashlib.sha256(f"{fp}:{shared.version}:{data.mixture}".encode()).hexdigest()[:16]\n',
        ("tests/test_mixture.py::test_the_sources_are_tokenized_once_each_and_the_weights_change_no_dataset",),
    ),
    Mutation(
        "mixture: the weights left out of the training identity",
        "components/identity.py",
        '        ident["mixture"] = mixture\n',
        "        pass\n",
        (
            "tests/pipeline/test_mixture_run.py::test_a_two_source_run_draws_by_weight_and_other_weights_tokenize_nothing",
        ),
    ),
    Mutation(
        "mixture: evaluate measures every source on the corpus's val blocks",
        "components/evaluate/stage.py",
        "            per[name] = perplexity(model, own, cfg.val_blocks, cfg.batch_size, lengths)\n",
        "            per[name] = perplexity(model, val, cfg.val_blocks, cfg.batch_size, lengths)\n",
        (
            "tests/pipeline/test_mixture_run.py::test_a_two_source_run_draws_by_weight_and_other_weights_tokenize_nothing",
        ),
    ),
    Mutation(
        "mixture: the mixture's val loss an unweighed mean of the sources'",
        "components/evaluate/metrics.py",
        '    loss = sum(w[n] * m["val_loss"] for n, m in per_source.items())\n',
        '    loss = sum(m["val_loss"] for m in per_source.values()) / len(per_source)\n',
        (
            "tests/pipeline/test_mixture_run.py::test_a_two_source_run_draws_by_weight_and_other_weights_tokenize_nothing",
        ),
    ),
    Mutation(
        "mixture: a capped source that cannot feed its share is sent to tokenize",
        "pipelines/cluster.py",
        "        if need > most:\n",
        "        if False:\n",
        (
            "tests/pipeline/test_mixture_run.py::test_a_capped_source_that_cannot_feed_its_share_is_refused_before_any_task",
        ),
    ),
    Mutation(
        "mixture: preflight lets a capped source run out",
        "components/mixture.py",
        "        if name in caps and need > caps[name] * blocks[name]:\n",
        "        if False:\n",
        ("tests/test_mixture.py::test_a_mixture_that_cannot_feed_the_run_is_refused_before_training",),
    ),
    Mutation(
        "mixture: a source of empty files is tokenized",
        "components/tokenize/plan.py",
        "        if files and sum(f.size for f in files) == 0:\n",
        "        if False:\n",
        ("tests/test_mixture.py::test_a_source_with_no_documents_is_refused_at_the_plan_naming_it",),
    ),
    Mutation(
        "mixture: a weight for an unknown source composes",
        "components/config/rules.py",
        '        ("data.mixture", not unknown,',
        '        ("data.mixture", True,',
        ("tests/test_mixture.py::test_a_bad_mixture_fails_at_compose_naming_the_key",),
    ),
    Mutation(
        "mixture: training validates the corpus only, no source on its own",
        "components/train/worker.py",
        "        sources = source_val_losses(job)\n",
        "        sources = {}\n",
        (
            "tests/pipeline/test_mixture_run.py::test_a_two_source_run_draws_by_weight_and_other_weights_tokenize_nothing",
        ),
    ),
    Mutation(
        "mixture: TensorBoard gets no per-source val curve",
        "components/train/monitor.py",
        '        for key in (k for k in record if k.startswith("val_loss/")):  # a mixture\'s sources\n',
        "        for key in ():\n",
        (
            "tests/pipeline/test_mixture_run.py::test_a_two_source_run_draws_by_weight_and_other_weights_tokenize_nothing",
        ),
    ),
    Mutation(
        "mixture: Prometheus serves no per-source val loss",
        "components/train/prometheus.py",
        "            self._val.labels(**self.labels, source=source).set(float(loss))\n",
        "            self._val.labels(**self.labels, source=source).set(0.0)\n",
        ("tests/test_mixture.py::test_a_training_serves_each_sources_val_loss_to_prometheus",),
    ),
    Mutation(
        "mixture: a rolled-back sampler counts on from where it was",
        "components/train/data.py",
        "        if sample < self.cursor:  # moved back (a rollback): count again from the start\n",
        "        if False:\n",
        ("tests/test_mixture.py::test_a_rolled_back_or_far_jumping_sampler_draws_what_a_fresh_one_does",),
    ),
    Mutation(
        "mixture: a position before the schedule's window reads the window",
        "components/train/data.py",
        "            if not self._w0 <= start or stop > self._w0 + len(self._wsrc):\n",
        "            if stop > self._w0 + len(self._wsrc):\n",
        ("tests/test_mixture.py::test_a_rolled_back_or_far_jumping_sampler_draws_what_a_fresh_one_does",),
    ),
    Mutation(
        "mixture: the corpus's version from its sources' names only",
        "components/tokenize/merge.py",
        "    version = hashlib.sha256(json.dumps(refs, sort_keys=True).encode()).hexdigest()[:16]\n",
        "    version = hashlib.sha256(json.dumps(sorted(refs)).encode()).hexdigest()[:16]\n",
        ("tests/test_mixture.py::test_a_sources_version_changes_with_its_own_blocks_only",),
    ),
    Mutation(
        "mixture: a source's version without the shared tokenizer's",
        "components/tokenize/plan.py",
        '        version = hashlib.sha256(f"{fp}:{shared.version}".encode()).hexdigest()[:16]\n',
        "        version = fp\n",
        ("tests/test_mixture.py::test_a_sources_version_changes_with_its_own_blocks_only",),
    ),
    Mutation(
        "mixture: the BPE's version from every source's whole fingerprint (a shard count retokenizes all)",
        "components/tokenize/plan.py",
        "    sampled = [] if tok.pretrained else sorted(sample_identity(s, f) for s, f, _, _ in listed.values())\n",
        "    sampled = [] if tok.pretrained else sorted(fp for *_, fp in listed.values())\n",
        ("tests/test_mixture.py::test_a_sources_version_changes_with_its_own_blocks_only",),
    ),
    Mutation(
        "mixture: the mixture's bits per byte over unweighed bytes",
        "components/evaluate/metrics.py",
        "        val_bits_per_byte=loss / math.log(2) / sum(w[n] * b for n, b in bytes_per_token.items()),\n",
        "        val_bits_per_byte=loss / math.log(2) / (sum(bytes_per_token.values()) / len(bytes_per_token)),\n",
        (
            "tests/pipeline/test_mixture_run.py::test_a_two_source_run_draws_by_weight_and_other_weights_tokenize_nothing",
        ),
    ),
    Mutation(
        "mixture: preflight's cap check with a constant slack",
        "components/mixture.py",
        "    return 3 + 2 * math.ceil(math.log2(samples + 2))\n",
        "    return 4\n",
        ("tests/test_mixture.py::test_the_preflight_check_bounds_the_schedules_excess_over_long_runs",),
    ),
    Mutation(
        "mixture: a seeded run of other weights continues the seed's order",
        "components/prelaunch.py",
        '            check_seed_mixture(seed, data, dataset, f"train.resume={train.resume}")\n',
        "            pass\n",
        ("tests/test_mixture.py::test_a_run_seeded_with_a_checkpoint_of_other_weights_is_refused",),
    ),
]


def dirty(paths: set[str]) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--", *sorted(paths)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return out.splitlines()


def run(mutation: Mutation, timeout_s: float) -> tuple[bool, float, str]:
    """(killed, seconds, the last failure line) with `mutation` applied."""
    original = mutation.apply()
    t0 = time.perf_counter()
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "", *mutation.tests]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("E ", "FAILED", "ERROR"))]
        return proc.returncode != 0, time.perf_counter() - t0, (failed[0] if failed else proc.stdout[-200:]).strip()
    except subprocess.TimeoutExpired:
        return True, time.perf_counter() - t0, f"timed out after {timeout_s:.0f} s (counted as killed: a hang)"
    finally:
        (ROOT / mutation.path).write_text(original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="substrings of the mutations to run (all by default)")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("--check", action="store_true", help="check every mutation applies, run nothing")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation's tests")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(n in m.name for n in args.names)]
    if args.list:
        for m in chosen:
            print(f"| {m.name} | `{m.path}` | {', '.join(f'`{t}`' for t in m.tests)} |")
        return 0
    for m in chosen:
        source = (ROOT / m.path).read_text()
        if source.count(m.old) != 1:
            print(f"does not apply: {m.name}: {m.old!r} is in {m.path} {source.count(m.old)} times", file=sys.stderr)
            return 2
    if args.check:
        print(f"{len(chosen)} mutations apply")
        return 0
    if changed := dirty({m.path for m in chosen}):
        print(f"commit or stash first: {', '.join(changed)}", file=sys.stderr)
        return 2
    survivors, t0 = [], time.perf_counter()
    for i, m in enumerate(chosen, 1):
        killed, seconds, line = run(m, args.timeout)
        print(
            f"[{i}/{len(chosen)}] {'killed' if killed else 'SURVIVED'} {seconds:5.0f} s  {m.name}: {line}", flush=True
        )
        if not killed:
            survivors.append(m.name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} killed in {time.perf_counter() - t0:.0f} s")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
