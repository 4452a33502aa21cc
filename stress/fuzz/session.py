"""The fuzzer proper: send generated steps, check every answer, settle the tasks it created.

``Fuzzer`` is transport-neutral (it holds a ``Driver``) and era-neutral (it holds an ``Era``).
What it found goes into a ``Ledger``: counts for the report and ``violations``, one line per
broken promise, which the tests assert empty.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import trio

from stress.fuzz.auth import Credentials
from stress.fuzz.drivers import Driver, Reply
from stress.fuzz.eras import MODERN, TASKS_EXTENSION, Era
from stress.fuzz.strategies import Catalogue, Pool, Step

log = logging.getLogger("stress.fuzz")

TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
LIVE_TASKS: Final = 12
"""Tasks the fuzzer lets wait at once: a runner runs 32 attempts by default and queues more
(they wait for a slot, which a fuzzed task waiting for input may never free). Waiting tasks
hold their attempt, so a polite client ends the oldest first: load is not what this fuzzes."""
TASKS_CAPS: Final[dict[str, Any]] = {"extensions": {TASKS_EXTENSION: {}}}
EXPECTED_CRASH: Final = "task tool protocol_error_job raised"
"""The fixture's deliberate crash: its traceback is in the log by design, once per task."""


def _text(detail: Mapping[str, Any]) -> str | None:
    result = detail.get("result")
    content = result.get("content") if isinstance(result, dict) else None
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _is_error(detail: Mapping[str, Any]) -> bool:
    result = detail.get("result")
    return isinstance(result, dict) and result.get("isError") is True


def _completed_with(prefix: str, *, error: bool = False) -> Callable[[Mapping[str, Any]], bool]:
    def check(detail: Mapping[str, Any]) -> bool:
        text = _text(detail) or ""
        return _is_error(detail) is error and text.startswith(prefix)

    return check


def _crashed(detail: Mapping[str, Any]) -> bool:
    return detail.get("error") == {"code": -32603, "message": "Task tool failed"}


def _undeclared_input(detail: Mapping[str, Any]) -> bool:
    """A task that asks for input the creating request did not declare it could answer."""
    error = detail.get("error")
    return isinstance(error, dict) and error.get("code") == -32021


@attrs.frozen
class Outcome:
    """What a task of one tool may end as: ``(status, check of the detail)`` pairs."""

    ends: Mapping[str, Callable[[Mapping[str, Any]], bool]]
    waits: str | None = None
    """The non-terminal state the task rests in until the client acts (``input_required``)."""

    def allows(self, detail: Mapping[str, Any]) -> bool:
        check = self.ends.get(str(detail.get("status")))
        return check is not None and check(detail)


def _always(detail: Mapping[str, Any]) -> bool:
    return True


TASK_OUTCOMES: Final[Mapping[str, Outcome]] = {
    "slow_compute": Outcome({"completed": _completed_with("Completed "), "cancelled": _always}),
    "failing_job": Outcome(
        {"completed": _completed_with("The task job failed", error=True), "cancelled": _always}
    ),
    "protocol_error_job": Outcome({"failed": _crashed, "cancelled": _always}),
    "confirm_delete": Outcome(
        {
            "completed": _completed_with("Delete confirmed: "),
            "cancelled": _always,
            "failed": _undeclared_input,
        },
        waits="input_required",
    ),
    "multi_input": Outcome(
        {
            "completed": _completed_with("Inputs received: "),
            "cancelled": _always,
            "failed": _undeclared_input,
        },
        waits="input_required",
    ),
    "test_tool_with_task": Outcome({"completed": _completed_with("Hello, "), "cancelled": _always}),
}
"""The states the conformance fixture's task tools imply (``examples/conformance_tasks.py``).
Only ``protocol_error_job`` may fail, and only with its designed ``Task tool failed``; any
other tool (an app that is not the fixture) may end any way but failed with ``-32603``."""

_ANY_BUT_INTERNAL: Final = Outcome(
    {
        "completed": _always,
        "cancelled": _always,
        "failed": lambda detail: (
            not (isinstance(detail.get("error"), dict) and detail["error"].get("code") == -32603)
        ),
    }
)


def _short(arguments: Any) -> bool:
    """``slow_compute`` arguments that finish at once (the tool sleeps ``max(0, seconds)``)."""
    seconds = arguments.get("seconds", 1) if isinstance(arguments, dict) else 1
    return isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds <= 1


@attrs.define
class TaskRecord:
    tool: str
    arguments: Any
    status: str = "working"
    detail: dict[str, Any] = attrs.field(factory=dict)
    cancelled_by_us: bool = False

    def describe(self) -> str:
        return f"{self.tool}({json.dumps(self.arguments, default=repr)[:200]})"


@attrs.define
class Ledger:
    """Everything the run saw: counts for the report, and what broke."""

    requests: int = 0
    """Every request sent: generated ones, and the fuzzer's own (discovery, tour, settling)."""
    generated: int = 0
    """Requests drawn by Hypothesis."""
    methods: Counter[str] = attrs.field(factory=Counter)
    statuses: Counter[str] = attrs.field(factory=Counter)
    errors: Counter[int] = attrs.field(factory=Counter)
    error_samples: dict[int, list[str]] = attrs.field(factory=dict)
    """A few messages per error code, for the report (what the refusals said)."""
    results: Counter[str] = attrs.field(factory=Counter)
    tasks: dict[str, TaskRecord] = attrs.field(factory=dict)
    violations: list[str] = attrs.field(factory=list)

    def violate(self, what: str, step: Step | None = None, reply: Reply | None = None) -> None:
        if len(self.violations) >= 50:
            return
        context = ""
        if step is not None:
            context += f" | {step.method} {json.dumps(step.params, default=repr)[:300]}"
        if reply is not None:
            shown = reply.final if reply.final is not None else reply.body[:300]
            context += f" | status {reply.status}: {json.dumps(shown, default=repr)[:300]}"
        self.violations.append(what + context)

    def report(self) -> dict[str, Any]:
        final = Counter(record.status for record in self.tasks.values())
        by_tool = Counter(record.tool for record in self.tasks.values())
        internal = [
            record.tool
            for record in self.tasks.values()
            if record.status == "failed"
            and (record.detail.get("error") or {}).get("code") == -32603
        ]
        return {
            "requests": self.requests,
            "generatedRequests": self.generated,
            "methods": dict(sorted(self.methods.items())),
            "httpStatuses": dict(sorted(self.statuses.items())),
            "errorCodes": {str(code): n for code, n in sorted(self.errors.items())},
            "errorSamples": {str(code): m for code, m in sorted(self.error_samples.items())},
            "resultTypes": dict(sorted(self.results.items())),
            "tasksCreated": len(self.tasks),
            "tasksByTool": dict(sorted(by_tool.items())),
            "tasksByFinalStatus": dict(sorted(final.items())),
            "tasksFailedInternal": len(internal),
            "tasksFailedInternalUnexpected": sum(
                1 for tool in internal if tool != "protocol_error_job"
            ),
            "violations": list(self.violations),
        }


class Fuzzer:
    """Sends steps over one ``Driver`` in one ``Era`` and checks what comes back."""

    def __init__(
        self,
        driver: Driver,
        era: Era = MODERN,
        *,
        budget: int | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.driver = driver
        self.credentials = credentials
        """The auth-on mode (HTTP): bearer tokens on every request, broken ones now and then."""
        self.era = era
        self.ledger = Ledger()
        self.pool = Pool()
        self.catalogue = Catalogue({}, {}, (), ())
        self.budget = budget
        """Stop sending generated requests once this many went out (``None``: no limit)."""
        self._ids = itertools.count(1)
        self._live: list[str] = []
        self.legacy = bool(era.opening())
        """The initialize era: a session to open, no tasks, server-initiated requests."""

    @property
    def exhausted(self) -> bool:
        return self.budget is not None and self.ledger.generated >= self.budget

    # -- requests --------------------------------------------------------------------------

    async def call(
        self,
        method: str,
        params: dict[str, Any],
        capabilities: Mapping[str, Any] | None = None,
        *,
        meta: Mapping[str, Any] | None = None,
        step: Step | None = None,
        generated: bool = False,
    ) -> Reply:
        request_id: int | str = next(self._ids)
        if request_id % 3 == 0:
            request_id = f"r{request_id}"  # string ids too
        param_headers = (
            self.catalogue.param_headers(str(params.get("name"))) if method == "tools/call" else {}
        )
        message, headers = self.era.request(
            request_id, method, params, capabilities or {}, meta=meta, param_headers=param_headers
        )
        fault = None
        if self.credentials is not None:
            value, fault = self.credentials.pick(generated)
            if value is not None:
                headers["authorization"] = value
        listen = method == "subscriptions/listen"
        self.ledger.requests += 1
        self.ledger.methods[method] += 1
        step = step or Step(method, params, dict(capabilities or {}), dict(meta or {}))
        answers = list(step.answers)

        async def answer(request: dict[str, Any]) -> None:
            """Answer what the server asked with the step's next drawn answer (then a refusal)."""
            asked = str(request.get("method"))
            self.ledger.methods[f"(server) {asked}"] += 1
            outcome = answers.pop(0) if answers else {"error": {"code": -32601, "message": "no"}}
            response, response_headers = self.era.response(request.get("id"), outcome)
            status = await self.driver.notify(response, self._authorized(response_headers))
            if status is not None:
                self.ledger.statuses[str(status)] += 1
                if status >= 500:
                    self.ledger.violate(f"HTTP {status} for the answer to {asked}", step)

        try:
            reply = await self.driver.send(message, headers, listen=listen, answer=answer)
        except trio.TooSlowError:
            reply = Reply(None, (), None, ("no answer within the request timeout (a hang)",))
        if fault is not None and self.credentials is not None:
            for problem in self.credentials.check(fault, reply.status, reply.www_authenticate):
                self.ledger.violate(problem, step, reply)
            self.ledger.statuses[str(reply.status)] += 1
            return reply
        if self.credentials is not None and reply.status in (401, 403):
            self.ledger.violate(f"HTTP {reply.status} for a valid token", step, reply)
        self._check(step, reply)
        return reply

    def _authorized(self, headers: dict[str, str]) -> dict[str, str]:
        if self.credentials is None:
            return headers
        return {**headers, "authorization": self.credentials.good()}

    async def open(self) -> None:
        """Send the era's opening (``initialize``, ``notifications/initialized``), if any."""
        for message in self.era.opening():
            if "id" not in message:
                _, headers = self.era.notification(str(message["method"]), {})
                await self.driver.notify(message, self._authorized(headers))
                continue
            _, headers = self.era.notification(str(message["method"]), {})
            headers = self._authorized(headers)
            self.ledger.requests += 1
            self.ledger.methods[str(message["method"])] += 1
            reply = await self.driver.send(message, headers)
            step = Step(str(message["method"]), dict(message.get("params") or {}), {}, {})
            self._check(step, reply)
            result = (reply.final or {}).get("result")
            requested = step.params.get("protocolVersion")
            if not isinstance(result, dict) or result.get("protocolVersion") != requested:
                self.ledger.violate(f"the session did not open at {requested}", step, reply)
            self.era.opened(reply.session_id)

    async def run(self, step: Step) -> Reply | None:
        if self.exhausted:
            return None
        self.ledger.generated += 1
        reply = await self.call(
            step.method, step.params, step.capabilities, meta=step.meta, step=step, generated=True
        )
        await self._end_oldest_tasks()
        return reply

    async def _end_oldest_tasks(self) -> None:
        """Keep at most ``LIVE_TASKS`` tasks running: look at the oldest, cancel it if it runs."""
        while len(self._live) > LIVE_TASKS:
            task_id = self._live.pop(0)
            record = self.ledger.tasks[task_id]
            detail = await self.task_detail(task_id)
            if detail is not None:
                record.status, record.detail = str(detail.get("status")), detail
            if record.status not in TERMINAL:
                await self.call("tasks/cancel", {"taskId": task_id}, TASKS_CAPS)
                record.cancelled_by_us = True

    def _check(self, step: Step, reply: Reply) -> None:
        ledger = self.ledger
        if reply.status is not None:
            ledger.statuses[str(reply.status)] += 1
            if reply.status >= 500:
                ledger.violate(f"HTTP {reply.status}", step, reply)
        for problem in reply.problems:
            ledger.violate(problem, step, reply)
        for frame in reply.messages:
            if frame.get("jsonrpc") != "2.0":
                ledger.violate("a message without jsonrpc 2.0", step, reply)
        final = reply.final
        if final is None:
            if step.method != "subscriptions/listen" and reply.status != 202 and not reply.problems:
                ledger.violate("no answer", step, reply)
            return
        error = final.get("error")
        if error is not None:
            code = error.get("code") if isinstance(error, dict) else None
            if not isinstance(code, int) or not isinstance(error.get("message"), str):
                ledger.violate("a malformed error", step, reply)
                return
            ledger.errors[code] += 1
            samples = ledger.error_samples.setdefault(code, [])
            if len(samples) < 3 and error["message"] not in samples:
                samples.append(error["message"][:200])
            if code == -32603 and not (
                self._deliberate(step) and error["message"] == "Task tool failed"
            ):
                ledger.violate("-32603", step, reply)
            return
        result = final.get("result")
        if not isinstance(result, dict):
            ledger.violate("a response without a result object", step, reply)
            return
        kind = str(result.get("resultType"))
        ledger.results[kind] += 1
        self._learn(step, result)

    def _deliberate(self, step: Step) -> bool:
        """The fixture's designed crash, called directly (the legacy era waits for its task and
        relays its failure: ``-32603 Task tool failed``)."""
        return (
            self.legacy
            and step.method == "tools/call"
            and step.params.get("name") == "protocol_error_job"
        )

    def _learn(self, step: Step, result: dict[str, Any]) -> None:
        """Remember what the server revealed: task ids, input keys, sealed states."""
        requests = result.get("inputRequests")
        if isinstance(requests, dict):
            for key in requests:
                if isinstance(key, str):
                    self.pool.add_key(key)
        kind = result.get("resultType")
        name = step.params.get("name")
        if step.method == "tools/call" and kind == "task":
            task_id = result.get("taskId")
            if isinstance(task_id, str) and task_id not in self.ledger.tasks:
                self.ledger.tasks[task_id] = TaskRecord(str(name), step.params.get("arguments"))
                self.pool.task_ids.append(task_id)
                self._live.append(task_id)
                if str(name) not in self.pool.task_tools:
                    self.pool.task_tools.append(str(name))
        state = result.get("requestState")
        if kind == "input_required" and isinstance(state, str) and isinstance(name, str):
            self.pool.states = [*self.pool.states[-63:], (name, state)]
        if step.method == "tasks/cancel" and kind == "complete":
            record = self.ledger.tasks.get(str(step.params.get("taskId")))
            if record is not None:
                record.cancelled_by_us = True

    # -- the app and its tasks -------------------------------------------------------------

    async def discover(self) -> Catalogue:
        """The app as its lists describe it (four valid requests)."""
        caps = {"elicitation": {}, "sampling": {}, "roots": {}, **TASKS_CAPS}

        async def listed(method: str, key: str) -> list[dict[str, Any]]:
            reply = await self.call(method, {}, caps)
            result = (reply.final or {}).get("result") or {}
            items = result.get(key)
            return (
                [item for item in items if isinstance(item, dict)]
                if isinstance(items, list)
                else []
            )

        tools = {
            str(t.get("name")): dict(t.get("inputSchema") or {})
            for t in await listed("tools/list", "tools")
        }
        prompts = {
            str(p.get("name")): tuple(
                str(a.get("name")) for a in p.get("arguments") or () if isinstance(a, dict)
            )
            for p in await listed("prompts/list", "prompts")
        }
        resources = tuple(str(r.get("uri")) for r in await listed("resources/list", "resources"))
        templates = tuple(
            str(t.get("uriTemplate"))
            for t in await listed("resources/templates/list", "resourceTemplates")
        )
        self.catalogue = Catalogue(tools, prompts, resources, templates)
        return self.catalogue

    async def tour(self) -> None:
        """One well-formed request of every kind, so every method is reached at least once and
        the pool holds real task ids and input keys before anything is generated.

        It calls the tools ``TASK_OUTCOMES`` names (those the catalogue has) as tasks, asks
        each task for its detail, answers the input a task asks for, cancels one, reads the
        first resource and template, gets the first prompt, completes its first argument and
        listens for the tasks.
        """
        if self.legacy:
            await self._legacy_tour()
            return
        caps = {"elicitation": {}, "sampling": {}, "roots": {}, **TASKS_CAPS}
        catalogue = self.catalogue
        for tool in TASK_OUTCOMES:
            if tool in catalogue.tools:
                await self.call("tools/call", {"name": tool, "arguments": {}}, caps)
        if "test_tool_with_task" in catalogue.tools:  # the MRTR round that becomes a task
            answer = {"action": "accept", "content": {"name": "Tour"}}
            params = {"name": "test_tool_with_task", "arguments": {}}
            await self.call("tools/call", {**params, "inputResponses": {"user_name": answer}}, caps)
        await trio.sleep(0.2)  # the input tasks reach input_required
        for task_id in list(self.ledger.tasks):
            detail = await self.task_detail(task_id)
            requests = (detail or {}).get("inputRequests")
            if isinstance(requests, dict) and requests:
                responses = {key: {"action": "accept", "content": {}} for key in requests}
                await self.call(
                    "tasks/update", {"taskId": task_id, "inputResponses": responses}, caps
                )
        if self.ledger.tasks:
            await self.call("tasks/cancel", {"taskId": next(iter(self.ledger.tasks))}, caps)
        else:
            await self.call("tasks/cancel", {"taskId": "no-such-task"}, caps)
        if catalogue.resources:
            await self.call("resources/read", {"uri": catalogue.resources[0]}, caps)
        if catalogue.templates:
            uri = catalogue.templates[0]
            while "{" in uri and "}" in uri:
                head, rest = uri.split("{", 1)
                uri = head + "tour" + rest.split("}", 1)[1]
            await self.call("resources/read", {"uri": uri}, caps)
        for prompt, arguments in sorted(catalogue.prompts.items())[:1]:
            await self.call(
                "prompts/get", {"name": prompt, "arguments": dict.fromkeys(arguments, "x")}, caps
            )
            ref = {"type": "ref/prompt", "name": prompt}
            argument = {"name": arguments[0] if arguments else "x", "value": "t"}
            await self.call("completion/complete", {"ref": ref, "argument": argument}, caps)
        wanted = {"toolsListChanged": True, "taskIds": list(self.ledger.tasks)[:5]}
        await self.call("subscriptions/listen", {"notifications": wanted}, caps)

    async def _legacy_tour(self) -> None:
        """Every tool once with no arguments (each input it asks for accepted), then one
        request of each legacy method, before anything is generated."""
        catalogue = self.catalogue
        accept = {"result": {"action": "accept", "content": {"name": "Tour", "confirm": True}}}
        for tool in sorted(catalogue.tools):
            step = Step("tools/call", {"name": tool, "arguments": {}}, {}, {}, (accept,) * 3)
            await self.call("tools/call", step.params, step=step)
        await self.call("logging/setLevel", {"level": "debug"})
        for uri in catalogue.resources[:1]:
            await self.call("resources/subscribe", {"uri": uri})
            await self.call("resources/read", {"uri": uri})
            await self.call("resources/unsubscribe", {"uri": uri})
        for prompt, arguments in sorted(catalogue.prompts.items())[:1]:
            await self.call(
                "prompts/get", {"name": prompt, "arguments": dict.fromkeys(arguments, "x")}
            )
            ref = {"type": "ref/prompt", "name": prompt}
            argument = {"name": arguments[0] if arguments else "x", "value": "t"}
            await self.call("completion/complete", {"ref": ref, "argument": argument})

    async def task_detail(self, task_id: str) -> dict[str, Any] | None:
        reply = await self.call("tasks/get", {"taskId": task_id}, TASKS_CAPS)
        result = (reply.final or {}).get("result")
        return result if isinstance(result, dict) else None

    async def settle(self, *, wait: float = 5.0, interval: float = 0.1) -> None:
        """Let every task reach the state its tool implies; end the waiting ones; check them.

        A task that should finish by itself (a short ``slow_compute``, ``failing_job``...) and
        is still running after ``wait`` seconds is a violation. Tasks that wait (for input, or
        a long sleep) are then cancelled, and must end ``cancelled``.
        """
        records = self.ledger.tasks
        deadline = trio.current_time() + wait
        pending = set(records)
        while pending and trio.current_time() < deadline:
            for task_id in sorted(pending):
                detail = await self.task_detail(task_id)
                if detail is None:
                    self.ledger.violate(f"task {task_id} ({records[task_id].tool}) vanished")
                    pending.discard(task_id)
                    continue
                record = records[task_id]
                record.status, record.detail = str(detail.get("status")), detail
                if record.status in TERMINAL or self._rests(record):
                    pending.discard(task_id)
            if pending:
                await trio.sleep(interval)
        for task_id, record in records.items():
            if record.status in TERMINAL:
                continue
            if not self._rests(record):
                self.ledger.violate(
                    f"task {task_id} of {record.describe()} is still {record.status} after {wait} s"
                )
            await self.call("tasks/cancel", {"taskId": task_id}, TASKS_CAPS)
            record.cancelled_by_us = True
        for task_id, record in records.items():
            if record.status in TERMINAL:
                continue
            last: dict[str, Any] | None = None
            with trio.move_on_after(wait):
                while True:
                    last = await self.task_detail(task_id)
                    if last is None or str(last.get("status")) in TERMINAL:
                        break
                    await trio.sleep(interval)
            if last is not None:
                record.status, record.detail = str(last.get("status")), last
        for task_id, record in records.items():
            outcome = TASK_OUTCOMES.get(record.tool, _ANY_BUT_INTERNAL)
            if not outcome.allows(record.detail):
                shown = {
                    k: record.detail.get(k) for k in ("status", "statusMessage", "error", "result")
                }
                self.ledger.violate(
                    f"task {task_id} of {record.describe()} "
                    f"ended {json.dumps(shown, default=repr)[:300]}"
                )
            if record.status == "cancelled" and not record.cancelled_by_us:
                self.ledger.violate(f"task {task_id} of {record.tool} was cancelled by nobody")

    def _rests(self, record: TaskRecord) -> bool:
        """The task is where its tool leaves it until a client acts (input, a long sleep)."""
        outcome = TASK_OUTCOMES.get(record.tool)
        if outcome is not None and outcome.waits == record.status:
            return True
        return record.tool == "slow_compute" and not _short(record.arguments)

    async def alive(self) -> bool:
        if self.legacy:
            reply = await self.call("ping", {}, {})
            if (reply.final or {}).get("result") != {}:
                self.ledger.violate("the server no longer answers ping", None, reply)
                return False
            return True
        reply = await self.call("server/discover", {}, {})
        result = (reply.final or {}).get("result")
        ok = isinstance(result, dict) and isinstance(result.get("supportedVersions"), list)
        if not ok:
            self.ledger.violate("the server no longer answers server/discover", None, reply)
        return ok


def tracebacks(log_text: str) -> tuple[int, int]:
    """(tracebacks in a server log, how many of them are the fixture's deliberate crash)."""
    return log_text.count("Traceback (most recent call last)"), log_text.count(EXPECTED_CRASH)


class LogWatch(logging.Handler):
    """Records, from an in-process server, every log record that carries a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.tracebacks: list[str] = []
        self.expected = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is None:
            return
        message = record.getMessage()
        if message.startswith(EXPECTED_CRASH):
            self.expected += 1
            return
        self.tracebacks.append(f"{record.name}: {message}: {self.format(record)[-1500:]}")
