"""``swebench``: SWE-bench (Verified) instances graded by running their tests in per-instance Docker images.

The replay path grades stored patches: ``harness eval --task swebench --backend replay --model gold.jsonl`` with
rows ``{"task": "swebench", "id": INSTANCE_ID, "completion": PATCH}``. The agent environment (multi-turn) is
built on :func:`open_instance_session` and :func:`grade_instance_patch`.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from opd_harness.task import DataError, DataNeed, DataNotFound, Problem, Score, Task, TaskNotReady, TaskOptions
from opd_harness.tasks.swebench import data, upstream
from opd_harness.tasks.agentic.shell_env import AgentLimits, system_prompt
from opd_harness.tasks.agentic.shell_task import chat_prompt
from opd_harness.tasks.swebench.agent import INSTANCE_PROMPT, SUBMIT, SwebenchAgentEnv
from opd_harness.tasks.swebench.grading import MAX_PATCH_BYTES, Outcome, failed, grade_patch, too_large
from opd_harness.tasks.swebench.session import InstanceSession, open_session_on
from opd_harness.tasks.swebench.images import (
    BuildInputs,
    BuildResult,
    ImageBuildError,
    base_image_id,
    build_instance_image,
    environment_pins,
    requirement_lines,
    sha256_file,
)

AGENT_WORKDIR = "/testbed"  # SWE-bench's repository path (a link to the sandbox work root in the instance images)
DEFAULT_CACHE = Path(".cache/swebench")


class SwebenchOptions(TaskOptions):
    k: int = 1
    max_new_tokens: int = 4096
    max_context_tokens: int = Field(
        32768, ge=256, description="agent: context budget of an episode (prompt, replies and observations); a turn past it ends the episode"
    )
    dataset: str = Field(
        "auto",
        description=(
            "rows: auto (<data dir>/swebench/verified_mini_50.csv or verified_mini_hf/, else the hub), a local file/folder, or hf:<name>"
        ),
    )
    instances: str = Field("", description="comma-separated instance ids (default: every instance with a snapshot, else every row)")
    repo_source: str = Field(
        "",
        description=(
            "repository trees: a snapshot folder (<id>/repo.tar.xz; default <data dir>/swebench/instances), "
            "a folder of git mirrors, or github"
        ),
    )
    cache_dir: str = Field(str(DEFAULT_CACHE), description="image build logs, pip cache, grading logs")
    grade_timeout_s: float = Field(1800.0, gt=0, description="wall-clock limit of one grading run (past it: fail, code grade_timeout)")
    test_tampering: Literal["fail", "strip", "off"] = Field(
        "fail",
        description="a patch that changes files steering the test run (conftest.py, pytest.ini, tox.ini, ...): fail (code test_tampering), "
        "strip (those files are left out), or off (graded as given, as SWE-bench does)",
    )
    max_patch_bytes: int = Field(
        MAX_PATCH_BYTES, ge=1, description="largest model patch graded (bytes); a larger one fails (code patch_too_large)"
    )
    rebuild: Literal["auto", "always", "never"] = Field(
        "auto",
        description="rebuild compiled extensions in place after the patch (setup.py build_ext --inplace, for specs that build them with "
        "the venv's tools): auto (when the patch changes .pyx/C sources), always, never",
    )
    grade_workers: int = Field(2, ge=1, description="instances graded at once")
    memory_mb: int = Field(4096, ge=256, description="memory of a grading or agent container")
    max_steps: int = Field(30, ge=1, description="agent: model turns (one bash command each) per episode")
    command_timeout_s: float = Field(60.0, gt=0, description="agent: wall-clock limit of one command")
    agent_exec_server: bool = Field(
        True, description="agent: commands as requests to the container's exec server (3.5x cheaper per command), or a docker exec "
        "each (false); same semantics (cwd, exports, time limits, output cut, network off)"
    )
    wall_time_s: float = Field(1800.0, gt=0, description="agent: wall-clock limit of an episode")
    max_format_errors: int = Field(3, ge=1, description="agent: consecutive replies without exactly one command that end the episode")
    max_output_chars: int = Field(10_000, ge=200, description="agent: command output kept per observation (head and tail)")
    action_format: Literal["fenced", "tagged"] = Field(
        "fenced", description="agent: one ```bash block per reply, or one <command>...</command>"
    )


class SwebenchTask(Task):
    description = "SWE-bench Verified: resolve GitHub issues; patches graded by the repository's tests in per-instance Docker images"
    Options = SwebenchOptions
    needs_sandbox = True
    multi_turn = True
    provides_references = False  # the gold patch is in Problem.solution, but it is no agent episode to warm a model up on
    episode_flags = ("repeated_loop", "premature_stop", "patch_apply_failure")

    def __init__(self, options: SwebenchOptions | None = None) -> None:
        super().__init__(options)
        self._rows: dict[str, dict] = {}
        self._images: dict[str, BuildResult] = {}

    @property
    def opts(self) -> SwebenchOptions:
        return self.options  # type: ignore[return-value]

    @property
    def cache_dir(self) -> Path:
        return Path(self.opts.cache_dir)

    # ---- data

    def data_dir(self, given: Path | None = None) -> Path:
        """The data root: ``given``, else ``options.data_dir``, else ``$HARNESS_DATA_DIR``, else ``./data``."""
        return self.data_root(given)[0]

    def repo_source(self, data_dir: Path | None = None) -> Path | str:
        src = self.opts.repo_source
        if src == "github":
            return "github"
        return Path(src) if src else self.data_dir(data_dir) / "swebench" / "instances"

    def load_rows(self, data_dir: Path | None = None) -> list[dict]:
        """Every validated row of the configured dataset."""
        ds = self.opts.dataset
        if ds.startswith("hf:"):
            return data.load_hub_rows(ds[3:])
        if ds != "auto":
            path = Path(ds)
            if not path.exists():
                raise DataNotFound(f"swebench: dataset {path} does not exist (task option dataset)")
            return data.load_rows(path)
        local = data.find_rows_file(self.data_dir(data_dir))
        if local is not None:
            return data.load_rows(local)
        try:
            return data.load_hub_rows()
        except Exception as exc:  # noqa: BLE001 - offline: say where we looked
            raise DataNotFound(
                f"swebench: no {' or '.join(data.LOCAL_FILES)} under {self.data_dir(data_dir) / 'swebench'} and the hub failed ({exc})"
            ) from None

    def read_problems(self, split: str, data_dir: Path) -> list[Problem]:
        rows = self.load_rows(data_dir)
        by_id = {r["instance_id"]: r for r in rows}
        wanted = [i.strip() for i in self.opts.instances.split(",") if i.strip()]
        source = self.repo_source(data_dir)
        if wanted:
            unknown = [i for i in wanted if i not in by_id]
            if unknown:
                raise DataError("task option instances", 0, "instances", f"unknown instance id(s): {', '.join(unknown)}")
            chosen = [by_id[i] for i in wanted]
        elif isinstance(source, Path) and data.snapshot_ids(source):
            have = data.snapshot_ids(source)
            chosen = [r for r in rows if r["instance_id"] in have]
        else:
            chosen = rows
        self._source = source
        for r in chosen:
            self._rows[r["instance_id"]] = r
        return [Problem(r["instance_id"], r["problem_statement"], r["patch"], solution=r["patch"], meta=r) for r in chosen]

    @classmethod
    def data_needs(cls):
        """``harness data fetch/check swebench``: the rows file (the repository snapshots are staged separately)."""
        return (
            DataNeed(
                task=cls.name,
                split="test",
                files=("swebench/verified*",),
                source=f"hf:{data.HUB_DATASET}[test]",
                fetch=data.fetch_hub,
                load=data.load_local,
            ),
        )

    # ---- images

    def build_inputs(self, row: dict) -> BuildInputs:
        """What the instance image is made from (see :mod:`opd_harness.tasks.swebench.images`)."""
        source = getattr(self, "_source", None) or self.repo_source()
        spec = upstream.spec_of(row["repo"], row["version"])
        tarball = data.repo_tarball(source, row, self.cache_dir)
        env_yml = data.environment_yml(source, row["instance_id"]) if isinstance(source, Path) else None
        pins = environment_pins(env_yml) if env_yml is not None else self.requirements_from_tree(row, tarball, spec)
        install = spec.get("install", "") if (pins or spec.get("install")) else ""
        return BuildInputs(
            instance_id=row["instance_id"],
            repo=row["repo"],
            version=row["version"],
            tarball=str(tarball),
            tarball_sha256=sha256_file(tarball),
            pins=tuple(pins),
            pre_install=tuple(spec.get("pre_install", [])),
            install=install,
            base_image_id=base_image_id(),
        )

    def requirements_from_tree(self, row: dict, tarball: Path, spec: dict) -> list[str]:
        """Without an environment.yml: the spec's requirements file read from the tree (swebench would fetch it from
        GitHub), plus the spec's ``pip_packages``."""
        import tarfile

        lines: list[str] = []
        if spec.get("packages") == "requirements.txt":
            with tarfile.open(tarball) as tf:
                names = set(tf.getnames())
                for rel in upstream.requirements_paths(row["repo"]):
                    if rel in names or f"./{rel}" in names:
                        member = tf.extractfile(rel if rel in names else f"./{rel}")
                        lines = requirement_lines(upstream.clean_requirements(member.read().decode()))
                        break
        return lines + list(spec.get("pip_packages", []))

    def ensure_image(self, row: dict, force: bool = False) -> BuildResult:
        """The instance's image, built now if it is missing (or ``force``)."""
        iid = row["instance_id"]
        if iid not in self._images or force:
            self._images[iid] = build_instance_image(self.build_inputs(row), self.cache_dir, force=force)
        return self._images[iid]

    def build_images(self, force: bool = False, on_start=None, on_done=None) -> list[BuildResult | Exception]:
        """Build the image of every selected instance (``harness sandbox build --task swebench``); a failed build is
        returned as its exception and the others go on. ``on_start(id)`` / ``on_done(id, result)`` report progress."""
        results: list[BuildResult | Exception] = []
        for problem in self.load():
            if on_start:
                on_start(problem.id)
            try:
                result: BuildResult | Exception = self.ensure_image(problem.meta, force=force)
            except (ImageBuildError, DataNotFound, KeyError, OSError) as exc:
                result = exc
            results.append(result)
            if on_done:
                on_done(problem.id, result)
        return results

    def check_ready(self) -> None:
        try:
            base_image_id()
        except ImageBuildError as exc:
            raise TaskNotReady(f"swebench: {exc}") from None
        try:
            upstream.module("harness.grading")
        except upstream.SwebenchMissing as exc:
            raise TaskNotReady(f"swebench: {exc}") from None

    # ---- grading

    def grade_patch(self, row: dict, patch: str) -> Outcome:
        """Build the instance image if needed, then grade ``patch`` on it (an image that cannot be built: ``error``).
        An empty patch is unresolved without running anything (as in SWE-bench, where it is never evaluated)."""
        if not patch.strip():
            return Outcome("fail", "empty patch (nothing to evaluate)", metrics={"empty_patch": 1.0, "patch_applied": 0.0})
        oversized = too_large(patch, self.opts.max_patch_bytes)  # before any image is built
        if oversized is not None:
            return oversized
        try:
            image = self.ensure_image(row).tag
        except (ImageBuildError, DataNotFound, KeyError, OSError) as exc:
            return Outcome("error", f"instance image: {exc}")
        opts = self.opts
        return grade_patch(row, patch, image, self.cache_dir / "logs", timeout_s=opts.grade_timeout_s, memory_mb=opts.memory_mb,
                           tampering=opts.test_tampering, max_patch_bytes=opts.max_patch_bytes, rebuild=opts.rebuild)  # fmt: skip

    def grade_many(self, problems: list[Problem], completions: list[str]) -> list[Score]:
        rows = [self._rows.get(p.id) or p.meta for p in problems]
        for row in {r["instance_id"]: r for r in rows}.values():  # build each image once, before grading in parallel
            try:
                self.ensure_image(row)
            except Exception:  # noqa: BLE001 - reported per problem by grade_patch
                pass
        from concurrent.futures import ThreadPoolExecutor  # with the first grading: `harness tasks` does not load it

        with ThreadPoolExecutor(self.opts.grade_workers) as pool:
            outcomes = list(pool.map(self.grade_patch, rows, completions))
        return [outcome_score(o, c) for o, c in zip(outcomes, completions, strict=True)]

    @property
    def grader(self) -> tuple[str, str]:
        return "swebench-docker", f"swebench=={upstream.SWEBENCH_VERSION}"

    # ---- the agent (multi-turn episodes; a stored patch is a one-turn episode)

    def format_prompt(self, problem: Problem, tokenizer) -> str:
        """mini-swe-agent's system and instance messages, through the model's chat template when it has one."""
        system = system_prompt(self.opts.action_format, SUBMIT)
        instance = INSTANCE_PROMPT.format(problem=problem.question, workdir=AGENT_WORKDIR, submit=SUBMIT)
        return chat_prompt(system, instance, tokenizer, self.opts.use_chat_template)

    def env(self, problem: Problem, tokenizer) -> SwebenchAgentEnv:
        """An agent episode on the instance; its container (and, if missing, its image) is made on the first command."""
        opts = self.opts
        row = self._rows.get(problem.id) or problem.meta
        limits = AgentLimits(
            opts.max_steps, opts.wall_time_s, opts.command_timeout_s, opts.max_format_errors, opts.max_output_chars, opts.max_patch_bytes
        )
        prompt = self.format_prompt(problem, tokenizer)
        return SwebenchAgentEnv(
            prompt, partial(self.open_session, row), workdir=AGENT_WORKDIR, limits=limits, action_format=opts.action_format
        )

    def open_session(self, row: dict):
        """A session in a fresh container of the instance image (network off), closed with the episode."""
        opts = self.opts
        return open_session_on(
            self.ensure_image(row).tag, memory_mb=opts.memory_mb, max_command_s=opts.command_timeout_s, served=opts.agent_exec_server
        )

    def grade_trajectories(self, problems: list[Problem], trajectories: list) -> list[Score]:
        """Grade each episode's patch (the agent's final ``git diff``, or the submitted diff) and flag premature stops:
        an empty patch, or an agent that submitted without running any test."""
        outcomes = [t.metadata.get("outcome", {}) for t in trajectories]
        patches = [o.get("patch", "") for o in outcomes]
        scores = self.grade_many(problems, patches)
        limit = self.opts.max_patch_bytes
        scores = [outcome_score(failed("patch_too_large",
                                       f"the agent's diff is over the {limit:,}-byte limit (task option max_patch_bytes)",
                                       metrics={"patch_applied": 0.0}), "") if o.get("patch_too_large") else s
                  for s, o in zip(scores, outcomes, strict=True)]  # fmt: skip
        out = []
        for score, traj, outcome, patch in zip(scores, trajectories, outcomes, patches, strict=True):
            episode = traj.metadata.get("episode", {})
            agent_ran = bool(outcome.get("commands"))
            empty = not patch.strip() and not outcome.get("patch_too_large")
            premature = empty or (agent_ran and episode.get("submitted") and not episode.get("ran_tests"))
            applied = score.metrics.get("patch_applied")
            flags = {"premature_stop": float(bool(premature)), "patch_apply_failure": float(applied == 0.0 and bool(patch.strip()))}
            out.append(dataclasses.replace(score, metrics={**score.metrics, **flags}))
        return out


def outcome_score(outcome: Outcome, patch: str) -> Score:
    """The Score of one graded patch: the reason and the log's path in ``details``, patch metrics in ``metrics``."""
    details = outcome.reason + (f"; log: {outcome.log_path}" if outcome.log_path else "")
    return Score(outcome.status, extracted=patch[:2000], details=details, metrics=dict(outcome.metrics))  # type: ignore[arg-type]


def task_for(instance: dict | str, options: dict[str, Any] | None = None) -> tuple[SwebenchTask, dict]:
    """A task (``options``: SwebenchOptions fields) and the row of ``instance`` (a row, or an id loaded from the data)."""
    task = SwebenchTask(SwebenchOptions(**(options or {})))
    if isinstance(instance, str):
        task.opts.instances = instance
        row = task.load()[0].meta
    else:
        row = data.validate_row(instance, "<row>", 0)
    return task, row


def grade_instance_patch(instance: dict | str, patch: str, options: dict[str, Any] | None = None) -> Score:
    """Grade one patch (e.g. an agent's final ``git diff``) on one instance; builds the image if it is missing."""
    task, row = task_for(instance, options)
    return outcome_score(task.grade_patch(row, patch), patch)


def open_instance_session(
    instance: dict | str,
    options: dict[str, Any] | None = None,
    *,
    memory_mb: int = 4096,
    cpus: float = 2.0,
    pids: int = 1024,
    tmpfs_mb: int = 1024,
    max_command_s: float = 1800.0,
) -> InstanceSession:
    """Open a session on ``instance`` (a SWE-bench row, or an instance id loaded with ``options``, the task options
    such as ``data_dir``/``repo_source``/``cache_dir``), building its image first if it is missing.

    Raises:
        ImageBuildError: the image could not be built. SandboxUnavailable: the container could not start."""
    task, row = task_for(instance, options)
    image = task.ensure_image(row).tag
    return open_session_on(image, memory_mb=memory_mb, cpus=cpus, pids=pids, tmpfs_mb=tmpfs_mb, max_command_s=max_command_s)
