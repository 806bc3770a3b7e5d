"""SWE-bench's shell agent: the kit's :class:`~opd_harness.tasks.agentic.shell_env.ShellAgentEnv` whose outcome is a patch.

The agent works in the instance container (network off) on the repository at ``/testbed`` and submits with
``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``. However it ends, its patch (:func:`patch_script`) is the diff against
the base commit (recorded when the session opens, so ``git commit``/``git stash``/``git reset`` cannot move it) of
every file git tracks (edited, deleted, committed) and every new file the agent staged with ``git add``; new files left
untracked (a reproduction script) are not in it. It is collected before the container goes; one over
``max_patch_bytes`` is not read (``patch_too_large``). A first reply that is itself a unified diff is taken as the
submitted patch (SWE-bench's prediction format), so stored predictions and agents go through the same episodes.
"""

from __future__ import annotations

import re
import shlex
import uuid
from collections.abc import Callable

from opd_harness.episode import StepResult
from opd_harness.tasks.agentic.shell_env import AgentLimits, ShellAgentEnv
from opd_harness.tasks.swebench import patches

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

INSTANCE_PROMPT = """<pr_description>
Consider the following PR description:
{problem}
</pr_description>

The repository is at {workdir}. Make changes to non-test files so that the issue in the PR description is resolved.
Recommended workflow: find the relevant code, write a script that reproduces the issue, edit the source, verify the fix
(run the reproduction and the relevant tests), then submit with: echo {submit}
Your patch is the diff against the original commit of the files git tracks (edited, deleted or committed) and of the new
files you `git add`; new files you do not `git add` (such as a reproduction script) are left out."""

GIT = f"{patches.GIT} --no-replace-objects"


def looks_like_patch(text: str) -> bool:
    """Whether a reply is a unified diff (a SWE-bench prediction) rather than an agent's turn."""
    head = text.lstrip()
    return head.startswith(("diff --git ", "--- a/", "--- ")) and "\n+++ " in head


def patch_script(workdir: str, base: str, max_bytes: int) -> str:
    """A bash script printing the episode's patch: a scratch index (outside the repository) holding the base tree,
    updated from the work tree for every path the base, ``HEAD`` or the agent's index knows, diffed against the base.
    Untracked files the agent never added are in none of them. Exit 3: the base commit is gone."""
    index = f"/tmp/.opd-patch-index-{uuid.uuid4().hex[:12]}"
    return (
        f"cd {shlex.quote(workdir)} || exit 2\n"
        f"{GIT} cat-file -e {base}^{{commit}} 2>/dev/null || exit 3\n"
        f"{{ {GIT} ls-tree -r -z --name-only {base}; {GIT} ls-tree -r -z --name-only HEAD 2>/dev/null; {GIT} ls-files -z 2>/dev/null; }}"
        f" | sort -zu > {index}.paths\n"
        f"export GIT_INDEX_FILE={index}\n"
        f"{GIT} read-tree {base} || exit 2\n"
        f"{GIT} update-index -q --add --remove --ignore-submodules -z --stdin < {index}.paths >/dev/null 2>&1\n"
        f"{GIT} diff --cached --no-color --no-ext-diff --no-textconv --binary {base} | head -c {max_bytes + 1}\n"
        f"rc=${{PIPESTATUS[0]}}; rm -f {index} {index}.paths\n"
        "[ $rc = 0 ] || [ $rc = 141 ]  # 141: cut by head at the limit (SIGPIPE)\n"
    )


class SwebenchAgentEnv(ShellAgentEnv):
    """A shell-agent episode on a git repository; its outcome is the patch against the commit the session opened on."""

    def __init__(
        self, prompt: str, open_session: Callable[[], object], *, workdir: str, limits: AgentLimits, action_format: str = "fenced"
    ) -> None:
        super().__init__(prompt, open_session, workdir=workdir, limits=limits, submit_word=SUBMIT, action_format=action_format)
        self.submitted_patch: str | None = None
        self.base_commit: str | None = None  # HEAD when the session opened: what the patch is diffed against

    def step(self, model_text: str) -> StepResult:
        if self.counts["steps"] == 0 and looks_like_patch(model_text):  # a prediction in SWE-bench's own format
            self.counts["steps"] = 1
            self.submitted_patch = model_text
            self.counts["submitted"] = 1
            return StepResult(None, True)
        return super().step(model_text)

    def on_session_open(self, session) -> None:
        """Record the repository's commit: the base of the patch."""
        from opd_harness.sandbox import ExecRequest

        head = session.run(ExecRequest(argv=["bash", "-c", f"cd {shlex.quote(self.workdir)} && {GIT} rev-parse HEAD"], timeout_s=60))
        if head.status != "ok" or head.exit_code != 0 or not re.fullmatch(r"[0-9a-f]{40,64}", head.stdout.strip()):
            raise RuntimeError(
                f"the repository in the session has no commit to diff against ({head.status}): {(head.stderr or head.error or '')[-300:]}"
            )
        self.base_commit = head.stdout.strip()

    def outcome(self) -> dict:
        """The episode's patch (:func:`patch_script`); ``patch_too_large`` when it is over ``max_patch_bytes``, and
        ``patch_note`` when the agent removed the base commit (an empty patch: the agent's doing, graded fail)."""
        from opd_harness.sandbox import ExecRequest

        if self.submitted_patch is not None:
            return {"patch": self.submitted_patch, "commands": []}
        if self._session is None:  # no command ever ran (a session opened by prepare is unused): the repository is untouched
            return {"patch": "", "commands": list(self.commands)}
        limit = self.limits.max_patch_bytes
        script = patch_script(self.workdir, self.base_commit or "HEAD", limit)
        result = self.session().run(ExecRequest(argv=["bash", "-c", script], timeout_s=120, max_output_bytes=limit + 1))
        if result.status == "ok" and result.exit_code == 3:
            return {
                "patch": "",
                "commands": list(self.commands),
                "patch_note": "the base commit is gone from the repository (the agent rewrote .git)",
            }
        if result.status != "ok" or result.exit_code != 0:
            why = (result.stderr or result.error or "")[-500:]
            raise RuntimeError(f"could not read the patch ({result.status}, exit {result.exit_code}): {why}")
        if len(result.stdout.encode(errors="surrogateescape")) > limit or result.stdout_truncated:
            return {"patch": "", "commands": list(self.commands), "patch_too_large": True}
        return {"patch": result.stdout, "commands": list(self.commands)}
