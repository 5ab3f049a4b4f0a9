"""What a CI event asks the planner for: event kind, cadence, PR labels, comment commands, trust.

Vocabulary (names of labels and commands live here and nowhere else):

- PR labels: ``run-ci-<label>`` runs the GPU tests carrying that domain label, ``run-ci-all``
  every GPU test, ``run-on-<arch>`` adds that GPU generation for tests that declare it,
  ``ok-to-test`` approves the GPU jobs of an untrusted author's head (see below),
  ``bypass-fastfail`` lets a pull request's GPU jobs start without waiting for its cheap checks
  and CPU lane (the fast-fail policy, below).
- Comment commands: a whole line of the comment ``/run-ci <label> [<label> …]``,
  ``/run-ci all``, ``/run-on <arch> [<arch> …]``, ``/rerun-failed`` (the test files that
  failed in the pull request's last run, as ``--failed-from`` history records of that run say)
  or ``/rerun-test <tests/…/test_x.py> […]``; everything else in the body is ignored.  They count
  only from trusted associations, and they say *what* to run, never that an untrusted head may
  run (see "Approval" below).  A rerun command makes the plan those files only (CPU and GPU,
  each on its derived pool, impact is not consulted; labels and ``/run-ci`` still add their GPU
  tests); a path that is not a registered test file (unregistered, a link, outside ``tests/``)
  is refused with a warning, and a rerun whose every path is refused plans nothing (it never
  falls back to the normal plan).

The comment grammar (:func:`read_commands`), strict so that a command is what a reader sees:

- The body is NFKC-normalised (a fullwidth ``／run-ci ｌｏｒａ`` reads as ``/run-ci lora``: it
  shows as that command, so it is one).
- A body holding any line separator other than ``\n`` and ``\r\n`` (U+2028, U+2029, VT, FF,
  FS, GS, RS, NEL, a lone CR), any other control (Cc: a tab too), format (Cf: zero-width
  joiners, bidi controls, …) or surrogate (Cs) character, or raw HTML (``<`` followed by a
  letter, ``/``, ``!`` or ``?``: an HTML comment ``<!--``, a tag such as ``<style>`` whose content
  GitHub does not show, ``<?…?>``, ``<!…>``) carries **no command at all**: such characters and
  markup can show a reader one line where a splitter sees two, or hide a line.  The plan's
  warnings say why a comment carried none.
- A command is a whole line (trailing spaces aside) that starts at its first column with ``/``,
  outside block quotes (a ``>`` line and the lines that continue it lazily, up to the next
  blank line), outside fenced code blocks (```` ``` ```` or ``~~~``, closed by a fence of the
  same character at least as long) and not indented (indented code).

Approval: an untrusted head's GPU jobs are planned when this very event asks for them (the
``labeled`` event that adds ``ok-to-test``, or an accepted command of a trusted comment); they
then run in the GitHub deployment environment :data:`UNTRUSTED_ENVIRONMENT`, whose required
reviewers (the maintainers) approve that run, pinned to the planned head, in GitHub itself.  No
text is parsed into an approval: a comment or a label says what to run, the environment's
reviewers approve.  A command that asks for nothing that can run (unknown labels or arches,
refused paths) asks for nothing: it plans nothing extra and approves nothing.

Per event:

========================  ================  ========================================  ===========
event                     CPU tests         GPU tests                                 arches
========================  ================  ========================================  ===========
pull_request              impacted          impacted + asked for by labels/comments   auto (+run-on)
push (main)               all               impacted                                  auto
merge_group               all               impacted                                  auto
schedule nightly          all               all enabled, nightly-only ones too        auto
schedule weekly           all               all enabled, nightly-only ones too        every declared
workflow_dispatch         as its cadence (default nightly), plus ``run-on`` arches
========================  ================  ========================================  ===========

Invariants:
- Trust is decided from event data only (never from the change): a pull request is trusted when
  it comes from a branch of the repository itself (``fork=False``: only writers can push there)
  or its author's association is OWNER, MEMBER or COLLABORATOR.  An unknown fork status
  (``fork=None``) is untrusted.  Pushes, merge queues and schedules run what the repository
  already holds.
- An untrusted pull request's CPU jobs run; its GPU jobs are planned only when this very event
  asks for them (the ``labeled`` event that adds ``ok-to-test``, or an accepted command of a
  trusted comment), and the plan's ``trusted: false`` sends them through the environment
  :data:`UNTRUSTED_ENVIRONMENT` (the workflow's rule, fail-closed: anything but ``trusted=true``).
  The caller pins the run to that head (the plan's ``head``); a later push needs a new ask.
- Comment commands from untrusted associations are ignored, with a warning in the plan.
- Fast-fail (:func:`fast_fail`): a pull request's GPU jobs wait for the cheap checks and the CPU
  lane of the same head to pass (GPU minutes are the expensive ones), unless the pull request
  carries ``bypass-fastfail``.  A label is trusted as GitHub records it: only a user with triage
  rights or more can add one, and nothing in a pull request's files or commits can; the bypass
  saves waiting, it approves nothing (an untrusted head's GPU jobs still wait for the
  environment's reviewers).  Pushes, merge queues, nightly and weekly runs never wait.
- Compile caches (:func:`compile_cache_scope`): a GPU job of a pull request's head, whoever
  its author, runs on a private copy of the runner's persistent compile cache (discarded with
  the job); only jobs of what the repository already holds (pushes, merge queues, schedules,
  dispatches) use the persistent one, so bytecode and kernels compiled by a head that is not
  merged never reach the runs of the default branch through the lane.
- Unknown labels, arches and commands never select anything silently: each is a warning, with
  the code points of any character outside printable ASCII (a look-alike is shown as such).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from ..fleet import Fleet
from .dispatch import Mode

EVENTS = ("pull_request", "push", "merge_group", "schedule", "workflow_dispatch")
CADENCES = ("nightly", "weekly")
TRUSTED_ASSOCIATIONS = frozenset({"OWNER", "MEMBER", "COLLABORATOR"})
RUN_CI_PREFIX = "run-ci-"
RUN_CI_ALL = "run-ci-all"
RUN_ON_PREFIX = "run-on-"
OK_TO_TEST = "ok-to-test"
BYPASS_FASTFAIL = "bypass-fastfail"
COMMANDS = ("run-ci", "run-on", "rerun-failed", "rerun-test")
_COMMAND = re.compile(r"/(run-ci|run-on|rerun-failed|rerun-test)(?: +(.*))?")
_TEST_PATH = re.compile(r"tests/(?:[A-Za-z0-9_.-]+/)*test_[A-Za-z0-9_]*\.py")
MAX_RERUN_FILES = 200  # a rerun of more files than this is a full run; ask for one
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_QUOTE = re.compile(r" *(?:(?:[-+*]|[0-9]{1,9}[.)]) +)*>")  # a block quote, perhaps in list items
_HTML = re.compile(r"<[A-Za-z/!?]")
#: Unicode categories no comment carrying a command may hold (``\n`` and ``\r\n`` aside):
#: controls, format characters, surrogates, line and paragraph separators.
FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
#: The GitHub deployment environment of the GPU jobs of an untrusted head: its required
#: reviewers approve each such run (README: "Approval of untrusted heads").
UNTRUSTED_ENVIRONMENT = "gpu-untrusted"
MAX_COMMANDS = 20  # per comment; more is a mistake (or an attack on the plan's size)


class RequestError(ValueError):
    """The inputs contradict each other (e.g. a cadence on a pull request)."""


@dataclass(frozen=True)
class Comment:
    """A PR comment and its author's association (``OWNER``, ``MEMBER``, ``NONE``, …)."""

    association: str
    body: str


@dataclass(frozen=True)
class Inputs:
    event: str = "pull_request"
    cadence: str | None = None
    labels: tuple[str, ...] = ()
    comments: tuple[Comment, ...] = ()
    author_association: str | None = None
    fork: bool | None = None  # None: unknown, which is untrusted
    action: str | None = None  # the pull_request activity type (opened, synchronize, labeled, …)
    label_added: str | None = None  # on a ``labeled`` event: the label it added
    #: the test files that failed (or errored) in the pull request's last run, from its history
    #: records (``--failed-from``); None: not given
    last_failed: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Request:
    """What to select, derived from :class:`Inputs` and the fleet's vocabulary."""

    event: str
    cadence: str | None
    cpu_all: bool
    gpu_all: bool  # every enabled GPU test (schedules)
    gpu_impacted: bool  # the GPU tests the change impacts
    gpu_labels: frozenset[str]  # domain labels asked for
    gpu_every_label: bool  # run-ci-all
    include_nightly: bool
    arch_mode: Mode
    arches: tuple[str, ...]
    trusted: bool
    gpu_blocked: str | None  # why no GPU job may run (untrusted author), else None
    #: for an untrusted author's head whose GPU jobs this event asks for: what asked, and who
    #: approves (the environment's reviewers); else None
    approval: str | None = None
    warnings: tuple[str, ...] = field(default=())
    #: rerun commands: {test file: why}; the plan is these files only.  None: no rerun command
    rerun: dict[str, str] | None = None
    #: whether the GPU jobs wait for the cheap checks and the CPU lane to pass, and why (or why not)
    fast_fail: bool = False
    fast_fail_reason: str = ""


def fast_fail(inputs: Inputs) -> tuple[bool, str]:
    """Whether the GPU jobs of ``inputs``' run wait for the cheap checks and the CPU lane of the
    same head (see the module docstring), and the reason, as the plan states it."""
    if inputs.event != "pull_request":
        what = inputs.cadence or inputs.event
        return False, f"{what} runs never fast-fail: GPU jobs do not wait for the CPU results"
    if BYPASS_FASTFAIL in inputs.labels:
        return False, f"the `{BYPASS_FASTFAIL}` label: GPU jobs start without waiting"
    return True, (
        "pull request: GPU jobs wait for the cheap checks and the CPU lane of this head to pass "
        f"(a maintainer's `{BYPASS_FASTFAIL}` label skips the wait)"
    )


#: The compile-cache scopes a plan hands to its GPU jobs (``compile_cache=`` output):
#: the runner's persistent cache, or a private copy of it for this job only.
SHARED_CACHE, PRIVATE_CACHE = "shared", "private"


def compile_cache_scope(event: str) -> str:
    """The compile cache a GPU job of an ``event`` run uses (see the module docstring): private
    for a pull request's head, shared for what the repository already holds."""
    return PRIVATE_CACHE if event == "pull_request" else SHARED_CACHE


def is_trusted(inputs: Inputs) -> bool:
    if inputs.event != "pull_request":
        return True  # pushes, merge queues and schedules run what is already in the repository
    association = (inputs.author_association or "").upper()
    return inputs.fork is False or association in TRUSTED_ASSOCIATIONS


def parse_commands(body: str) -> list[tuple[str, list[str]]]:
    """``[(command, args)]`` of a comment under the grammar of the module docstring (none when
    the body may not carry commands: :func:`read_commands` says why)."""
    return read_commands(body)[0]


def read_commands(body: str) -> tuple[list[tuple[str, list[str]]], str | None]:
    """``(commands, refused)``: the commands of ``body`` (at most :data:`MAX_COMMANDS`), and
    ``None`` or why the body carries no command at all (see the module docstring)."""
    refused = why_no_commands(body)
    if refused:
        return [], refused
    text = unicodedata.normalize("NFKC", body).replace("\r\n", "\n")
    out = []
    for line in command_lines(text.split("\n")):
        m = _COMMAND.fullmatch(line.rstrip(" "))
        if m:
            out.append((m.group(1), (m.group(2) or "").replace(",", " ").split()))
    return out[:MAX_COMMANDS], None


def why_no_commands(body: str) -> str | None:
    """Why ``body`` carries no command (a forbidden character or raw HTML, in the body or its
    NFKC form), or None."""
    for text in (body, unicodedata.normalize("NFKC", body)):
        for i, c in enumerate(text):
            if c == "\n" or (c == "\r" and text[i + 1 : i + 2] == "\n"):
                continue
            if unicodedata.category(c) in FORBIDDEN_CATEGORIES:
                name = unicodedata.name(c, "") or f"a {unicodedata.category(c)} character"
                return (
                    f"it holds U+{ord(c):04X} ({name}); a comment with a line separator other "
                    "than a newline, a control or a format character carries no command"
                )
        if _HTML.search(text):
            return (
                "it holds raw HTML (`<!--`, a tag, `<?` or `<!`), which can hide a line from "
                "the reader; a comment with HTML carries no command"
            )
    return None


def command_lines(lines: list[str]) -> list[str]:
    """The lines that may be commands: not in a fenced code block, not in a block quote (a ``>``
    line and its lazy continuation up to a blank line)."""
    out = []
    fence: tuple[str, int] | None = None  # the open fence's character and length
    quoted = False
    for line in lines:
        if fence is not None:
            char, length = fence
            if re.fullmatch(f" {{0,3}}{re.escape(char)}{{{length},}} *", line):
                fence = None
            continue
        m = _FENCE.match(line)
        if m:
            fence, quoted = (m.group(1)[0], len(m.group(1))), False
        elif not line.strip(" "):
            quoted = False
        elif _QUOTE.match(line):
            quoted = True
        elif not quoted:
            out.append(line)
    return out


def shown_name(name: str) -> str:
    """``name`` as a warning shows it: printable ASCII as is, anything else with its code points
    (``run‐ci`` is not ``run-ci``)."""
    if name.isascii() and name.isprintable():
        return repr(name)
    points = " ".join(f"U+{ord(c):04X}" for c in name if not (c.isascii() and c.isprintable()))
    return f"{name!a} (not plain ASCII: {points})"


def build_request(inputs: Inputs, fleet: Fleet) -> Request:
    """The :class:`Request` for ``inputs``; :class:`RequestError` for contradictory inputs."""
    cadence = _cadence(inputs)
    asks = _Asks(fleet, inputs.last_failed)
    asks.read_labels(inputs.labels)
    asks.read_comments(inputs.comments)
    if inputs.event in ("merge_group", "push") and (asks.labels or asks.every_label or asks.arches):
        asks.warnings.append(
            f"labels and comment commands apply to pull requests, not {inputs.event}"
        )
        asks.labels, asks.every_label, asks.arches = set(), False, []
    if inputs.event != "pull_request" and asks.rerun is not None:
        asks.warnings.append(f"rerun commands apply to pull requests, not {inputs.event}")
        asks.rerun = None
    trusted = is_trusted(inputs)
    approval = None if trusted else _approval(inputs, asks.accepted)
    waits, why_waits = fast_fail(inputs)
    scheduled = inputs.event in ("schedule", "workflow_dispatch")
    if scheduled:
        mode = Mode.ALL if cadence == "weekly" else (Mode.EXPLICIT if asks.arches else Mode.AUTO)
    else:
        mode = Mode.EXPLICIT if asks.arches else Mode.AUTO
    return Request(
        event=inputs.event,
        cadence=cadence,
        cpu_all=inputs.event != "pull_request",
        gpu_all=scheduled,
        gpu_impacted=not scheduled,
        gpu_labels=frozenset(asks.labels),
        gpu_every_label=asks.every_label,
        include_nightly=scheduled,
        arch_mode=mode,
        arches=tuple(dict.fromkeys(asks.arches)),
        trusted=trusted,
        gpu_blocked=None if trusted or approval else _why_gpu_blocked(inputs),
        approval=approval,
        warnings=tuple(asks.warnings),
        rerun=asks.rerun,
        fast_fail=waits,
        fast_fail_reason=why_waits,
    )


def _cadence(inputs: Inputs) -> str | None:
    """The cadence the event runs at; :class:`RequestError` when event and cadence disagree."""
    if inputs.event not in EVENTS:
        raise RequestError(f"unknown event {inputs.event!r}; use one of {', '.join(EVENTS)}")
    cadence = inputs.cadence
    if inputs.event == "schedule" and cadence not in CADENCES:
        raise RequestError(f"a schedule needs --cadence {' or '.join(CADENCES)}")
    if inputs.event == "workflow_dispatch":
        cadence = cadence or "nightly"
        if cadence not in CADENCES:
            raise RequestError(f"--cadence must be {' or '.join(CADENCES)}, got {cadence!r}")
    elif inputs.event != "schedule" and cadence is not None:
        raise RequestError(
            f"--cadence applies to schedule and workflow_dispatch, not {inputs.event}"
        )
    return cadence


class _Asks:
    """What labels and comment commands ask for, checked against the fleet's vocabulary; every
    name it does not know is a warning, never a silent selection."""

    def __init__(self, fleet: Fleet, last_failed: tuple[str, ...] | None):
        self.fleet = fleet
        self.last_failed = last_failed
        self.labels: set[str] = set()
        self.every_label = False
        self.arches: list[str] = []
        self.rerun: dict[str, str] | None = None
        self.warnings: list[str] = []
        #: the trusted commands that asked for something that can run (``/run-ci lora``)
        self.accepted: list[str] = []

    def rerun_file(self, path: str, why: str, where: str) -> bool:
        """Add ``path`` to the rerun; False (with a warning) when it is refused."""
        if not (path.isascii() and _TEST_PATH.fullmatch(path)) or ".." in path.split("/"):
            self.warnings.append(
                f"{where}: {shown_name(path)} is not a test file path; give a repository path "
                "such as tests/train/test_x.py"
            )
            return False
        rerun = self.rerun if self.rerun is not None else {}
        if path not in rerun and len(rerun) >= MAX_RERUN_FILES:
            self.warnings.append(
                f"{where}: more than {MAX_RERUN_FILES} files to rerun; the rest are ignored "
                "(ask for a full run instead)"
            )
            return False
        rerun.setdefault(path, why)
        self.rerun = rerun
        return True

    def rerun_failed(self, args: list[str]) -> bool:
        self.rerun = self.rerun if self.rerun is not None else {}
        if args:
            self.warnings.append("/rerun-failed takes no arguments; they were ignored")
        if self.last_failed is None:
            self.warnings.append(
                "/rerun-failed: no record of this pull request's last run was given "
                "(--failed-from), so nothing is rerun"
            )
        elif not self.last_failed:
            self.warnings.append("/rerun-failed: no test failed in this pull request's last run")
        return any(
            [
                self.rerun_file(path, "/rerun-failed: failed in the last run", "/rerun-failed")
                for path in self.last_failed or ()
            ]
        )

    def label(self, name: str, where: str) -> bool:
        if name == "all":
            self.every_label = True
        elif name in self.fleet.labels:
            self.labels.add(name)
        else:
            known = ", ".join(sorted(self.fleet.labels))
            self.warnings.append(f"{where}: unknown test label {shown_name(name)} (known: {known})")
            return False
        return True

    def arch(self, name: str, where: str) -> bool:
        if name in self.fleet.generation_names:
            self.arches.append(name)
            return True
        known = ", ".join(self.fleet.generation_names)
        self.warnings.append(f"{where}: unknown GPU generation {shown_name(name)} (known: {known})")
        return False

    def read_labels(self, labels: tuple[str, ...]) -> None:
        for label in labels:
            if label == RUN_CI_ALL:
                self.every_label = True
            elif label.startswith(RUN_CI_PREFIX):
                self.label(label[len(RUN_CI_PREFIX) :], f"label {shown_name(label)}")
            elif label.startswith(RUN_ON_PREFIX):
                self.arch(label[len(RUN_ON_PREFIX) :], f"label {shown_name(label)}")
            elif label == "all" or label in self.fleet.labels:  # a test label without its prefix
                self.warnings.append(
                    f"label {shown_name(label)} asks for nothing: a pull request label selects "
                    f"tests as {shown_name(RUN_CI_PREFIX + label)}; add that label instead"
                )
            elif label in self.fleet.generation_names:
                self.warnings.append(
                    f"label {shown_name(label)} asks for nothing: a pull request label picks a "
                    f"GPU generation as {shown_name(RUN_ON_PREFIX + label)}; add that label instead"
                )

    def read_comments(self, comments: tuple[Comment, ...]) -> None:
        for comment in comments:
            commands, refused = read_commands(comment.body)
            if refused:
                self.warnings.append(
                    f"a comment from {comment.association} carries no command: {refused}"
                )
                continue
            if not commands:
                continue
            if comment.association.upper() not in TRUSTED_ASSOCIATIONS:
                self.warnings.append(
                    f"ignored comment command(s) {', '.join('/' + c for c, _ in commands)} from "
                    f"an author with association {comment.association}: only "
                    f"{', '.join(sorted(TRUSTED_ASSOCIATIONS))} may ask for GPU runs"
                )
                continue
            for command, args in commands:
                if self.command(command, args):
                    self.accepted.append(" ".join(["/" + command, *args]))
                else:
                    self.warnings.append(
                        f"/{command} asked for nothing that can run: it plans nothing and "
                        "approves nothing"
                    )

    def command(self, command: str, args: list[str]) -> bool:
        """Apply one trusted command; whether it asked for anything that can run."""
        if command == "rerun-failed":
            return self.rerun_failed(args)
        if command == "rerun-test":  # a rerun, even of nothing: never the normal plan
            self.rerun = self.rerun if self.rerun is not None else {}
        if not args:
            self.warnings.append(f"/{command} without arguments does nothing")
        accepted = []
        for arg in args:
            where = f"/{command} {shown_name(arg)}"
            if command == "rerun-test":
                accepted.append(self.rerun_file(arg, f"/rerun-test {arg}", where))
            else:
                accepted.append((self.label if command == "run-ci" else self.arch)(arg, where))
        return any(accepted)


def _approval(inputs: Inputs, accepted: list[str]) -> str | None:
    """For an untrusted pull request's head: what in this very event asks for its GPU jobs, and
    who approves them (the environment's reviewers), or None when nothing asks."""
    if inputs.action == "labeled" and inputs.label_added == OK_TO_TEST:
        asked = f"the `{OK_TO_TEST}` label added on this head"
    elif accepted:
        asked = f"a trusted comment ({', '.join(accepted[:3])})"
    else:
        return None
    return (
        f"{asked} asks for its GPU jobs; they run in the GitHub environment "
        f"`{UNTRUSTED_ENVIRONMENT}` once its required reviewers approve this run"
    )


def _why_gpu_blocked(inputs: Inputs) -> str:
    """Why an untrusted author's GPU jobs may not run in this event."""
    fork = {True: "fork", False: "same repository", None: "fork status unknown"}[inputs.fork]
    return (
        f"author not trusted (association {inputs.author_association or 'unknown'}, {fork}): "
        f"GPU jobs are planned when a maintainer adds the `{OK_TO_TEST}` label or comments "
        f"`/run-ci <label>`, and then run once a required reviewer of the GitHub environment "
        f"`{UNTRUSTED_ENVIRONMENT}` approves that run; it holds for the head it was given on, a "
        "later push needs a new one"
    )
