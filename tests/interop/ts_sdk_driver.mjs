// Drive a tritask server with the TypeScript SDK `@modelcontextprotocol/sdk` (1.32.2), the
// initialize-era client most hosts embed, and print one JSON document of what it saw.
//
//   node ts_sdk_driver.mjs SDK_DIR http URL
//   node ts_sdk_driver.mjs SDK_DIR stdio COMMAND [ARG...]
//
// SDK_DIR is the installed package (`.../node_modules/@modelcontextprotocol/sdk`): the SDK is
// installed at test time under `.cache/`, outside this directory, so its modules are imported
// by path. Only the SDK's public client API is used. Two clients run one after the other:
//
// * `plain` declares only `elicitation`, like most hosts: tools, resources, prompts, ping,
//   logging/setLevel, progress, an elicitation the server requests while a tool runs, a task
//   tool called with plain `callTool` (the request waits for the task), and cancellation by
//   AbortSignal (the SDK sends notifications/cancelled) of a tool and of a task tool.
// * `tasks` also declares `tasks`: the 2025-11-25 experimental task flow through
//   `client.experimental.tasks` (callToolStream, getTask, getTaskResult, listTasks,
//   cancelTask).
//
// Every step records its value or its error, so one failing step does not hide the others;
// the pytest side asserts exact values. `wire` lists every JSON-RPC message each client sent
// (">") and received ("<"), for the failure reports.

import path from 'node:path';
import process from 'node:process';
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

const [sdkDir, transportKind, ...target] = process.argv.slice(2);
const STEP_TIMEOUT_MS = 20_000;
const DRIVER_TIMEOUT_MS = 120_000;

const load = sub => import(pathToFileURL(path.join(sdkDir, 'dist', 'esm', sub)).href);
const { Client } = await load('client/index.js');
const { StreamableHTTPClientTransport } = await load('client/streamableHttp.js');
const { StdioClientTransport } = await load('client/stdio.js');
const { CallToolResultSchema, ElicitRequestSchema } = await load('types.js');

const output = {
    sdkVersion: JSON.parse(readFileSync(path.join(sdkDir, 'package.json'), 'utf8')).version,
    node: process.version,
    transport: transportKind,
    wire: {}
};

function emit(code) {
    process.stdout.write(JSON.stringify(output) + '\n', () => process.exit(code));
}

const watchdog = setTimeout(() => {
    output.timedOut = true;
    emit(2);
}, DRIVER_TIMEOUT_MS);

function describe(error) {
    if (error === null || typeof error !== 'object') {
        return { name: typeof error, message: String(error) };
    }
    const described = { name: error.name ?? error.constructor?.name, message: error.message };
    if (error.code !== undefined) described.code = error.code;
    if (error.data !== undefined) described.data = error.data;
    return described;
}

function withTimeout(promise, label) {
    let timer;
    const timeout = new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(`${label}: no answer within ${STEP_TIMEOUT_MS} ms`)), STEP_TIMEOUT_MS);
    });
    return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

async function step(into, name, fn) {
    try {
        into[name] = await withTimeout(Promise.resolve().then(fn), name);
    } catch (error) {
        into[name] = { error: describe(error) };
    }
}

// Record every message the client sends and receives, without changing what it does.
function tap(transport, log) {
    const send = transport.send.bind(transport);
    transport.send = (message, options) => {
        log.push(['>', message]);
        return send(message, options);
    };
    let handler;
    Object.defineProperty(transport, 'onmessage', {
        configurable: true,
        get: () => handler,
        set: fn => {
            handler = fn && ((message, extra) => {
                log.push(['<', message]);
                fn(message, extra);
            });
        }
    });
    return transport;
}

function openTransport() {
    if (transportKind === 'http') {
        return new StreamableHTTPClientTransport(new URL(target[0]));
    }
    if (transportKind === 'stdio') {
        // The SDK passes only a few variables (PATH, HOME, ...) by default: PYTHONPATH is needed.
        return new StdioClientTransport({
            command: target[0],
            args: target.slice(1),
            env: { ...process.env },
            stderr: 'inherit'
        });
    }
    throw new Error(`unknown transport ${transportKind}`);
}

async function connect(name, capabilities, setup) {
    const log = [];
    output.wire[name] = log;
    const client = new Client({ name: `tritask-ts-interop-${name}`, version: '1.0.0' }, { capabilities });
    // What the SDK reports through onerror while the client works (protocol errors, unknown
    // response ids, late progress...). Closing aborts the client's own open streams (the GET
    // stream over HTTP), which the SDK reports too: that is not the server's doing.
    const errors = [];
    const state = { closing: false };
    client.onerror = error => {
        if (!state.closing) errors.push(describe(error).message);
    };
    setup?.(client);
    const transport = tap(openTransport(), log);
    await client.connect(transport);
    const close = async () => {
        state.closing = true;
        await client.close();
    };
    return { client, transport, errors, close };
}

function text(result) {
    return (result.content ?? []).map(block => block.text).join('');
}

// Poll a counting tool until it has moved past `before` (the server saw a cancellation).
async function counterAfter(client, tool, before) {
    const deadline = Date.now() + STEP_TIMEOUT_MS;
    for (;;) {
        const value = Number(text(await client.callTool({ name: tool, arguments: {} })));
        if (value > before || Date.now() > deadline) return value - before;
        await new Promise(resolve => setTimeout(resolve, 20));
    }
}

async function counter(client, tool) {
    return Number(text(await client.callTool({ name: tool, arguments: {} })));
}

// Call `tool`, abort the request once its first progress notification arrives, and count
// the cancellations the server saw (none to wait for when the call was not aborted).
async function abortAndCount(client, tool, counterTool) {
    const before = await counter(client, counterTool);
    const call = await abortOnProgress(client, tool);
    const cancelledOnServer = call.error ? await counterAfter(client, counterTool, before) : 0;
    return { ...call, cancelledOnServer };
}

async function abortOnProgress(client, tool) {
    const controller = new AbortController();
    let progressSeen = 0;
    try {
        const result = await client.callTool({ name: tool, arguments: {} }, undefined, {
            signal: controller.signal,
            onprogress: () => {
                progressSeen += 1;
                controller.abort('driver abort');
            }
        });
        return { progressSeen, result };
    } catch (error) {
        return { progressSeen, error: describe(error) };
    }
}

// Call `tool` with progress, and open its gate once the last of its 3 progress steps is in:
// the SDK drops progress it reads together with the response (see legacy_app.py).
async function gatedProgress(client, tool, gate) {
    const seen = [];
    let released = null;
    const result = await client.callTool({ name: tool, arguments: { parts: 3, gate } }, undefined, {
        onprogress: progress => {
            seen.push(progress);
            if (seen.length === 3) {
                released = client.callTool({ name: 'release', arguments: { gate } }).then(text, describe);
            }
        }
    });
    return { result, progress: seen, released: await released };
}

async function plainClient() {
    const results = {};
    output.plain = results;
    const asked = [];
    const { client, transport, errors, close } = await connect('plain', { elicitation: {} }, client => {
        client.setRequestHandler(ElicitRequestSchema, async request => {
            asked.push(request.params);
            return { action: 'accept', content: { name: 'Ada' } };
        });
    });
    results.connect = {
        serverVersion: client.getServerVersion(),
        capabilities: client.getServerCapabilities(),
        instructions: client.getInstructions() ?? null,
        protocolVersion: transport.protocolVersion ?? null,
        sessionId: transport.sessionId === undefined ? null : /^[\x21-\x7E]+$/.test(transport.sessionId)
    };
    await step(results, 'ping', () => client.ping());
    await step(results, 'setLoggingLevel', () => client.setLoggingLevel('info'));
    await step(results, 'listTools', () => client.listTools());
    await step(results, 'callAdd', () => client.callTool({ name: 'add', arguments: { a: 2, b: 40 } }));
    await step(results, 'unknownTool', () => client.callTool({ name: 'no_such_tool', arguments: {} }));
    await step(results, 'listResources', () => client.listResources());
    await step(results, 'listResourceTemplates', () => client.listResourceTemplates());
    await step(results, 'readReadme', () => client.readResource({ uri: 'interop://readme' }));
    await step(results, 'readItem', () => client.readResource({ uri: 'interop://items/widget' }));
    await step(results, 'subscribe', () => client.subscribeResource({ uri: 'interop://readme' }));
    await step(results, 'unsubscribe', () => client.unsubscribeResource({ uri: 'interop://readme' }));
    await step(results, 'listPrompts', () => client.listPrompts());
    await step(results, 'getPrompt', () =>
        client.getPrompt({ name: 'review', arguments: { language: 'python', code: 'x = 1' } })
    );
    await step(results, 'progress', () => gatedProgress(client, 'tally', `${transportKind}-tally`));
    await step(results, 'elicitation', async () => {
        const result = await client.callTool({ name: 'greet', arguments: { greeting: 'Hi' } });
        return { result, asked: asked.splice(0) };
    });
    await step(results, 'waitedTask', () => gatedProgress(client, 'report', `${transportKind}-report`));
    await step(results, 'cancelTool', () => abortAndCount(client, 'wait', 'cancelled_waits'));
    await step(results, 'cancelWaitedTask', () => abortAndCount(client, 'hold', 'cancelled_holds'));
    // The connection outlives the cancelled calls.
    await step(results, 'afterCancel', () => client.callTool({ name: 'add', arguments: { a: 1, b: 1 } }));
    if (transportKind === 'http') {
        await step(results, 'terminateSession', async () => {
            await transport.terminateSession();
            return { sessionId: transport.sessionId ?? null };
        });
    }
    results.clientErrors = errors.slice();
    await close();
}

async function tasksClient() {
    const results = {};
    output.tasks = results;
    const { client, errors, close } = await connect('tasks', { elicitation: {}, tasks: { list: {}, cancel: {} } });
    const tasks = client.experimental.tasks;
    results.connect = { capabilities: client.getServerCapabilities() };
    await step(results, 'listTools', async () => {
        const listed = await client.listTools();
        return Object.fromEntries(listed.tools.map(tool => [tool.name, tool.execution ?? null]));
    });
    let reportId = null;
    await step(results, 'stream', async () => {
        const messages = [];
        for await (const message of tasks.callToolStream({ name: 'report', arguments: { parts: 2 } })) {
            if (message.type === 'taskCreated') {
                reportId = message.task.taskId;
                messages.push({ type: message.type, task: message.task });
            } else if (message.type === 'taskStatus') {
                messages.push({ type: message.type, status: message.task.status, taskId: message.task.taskId });
            } else if (message.type === 'result') {
                messages.push({ type: message.type, result: message.result });
            } else {
                messages.push({ type: message.type, error: describe(message.error) });
            }
        }
        return messages;
    });
    await step(results, 'getTask', () => tasks.getTask(reportId));
    await step(results, 'getTaskResult', () => tasks.getTaskResult(reportId, CallToolResultSchema));
    let holdId = null;
    await step(results, 'cancel', async () => {
        const before = await counter(client, 'cancelled_holds');
        const messages = [];
        let cancelled = null;
        for await (const message of tasks.callToolStream({ name: 'hold', arguments: {} })) {
            if (message.type === 'taskCreated') {
                holdId = message.task.taskId;
                messages.push({ type: message.type, status: message.task.status });
                cancelled = await tasks.cancelTask(holdId);
            } else if (message.type === 'taskStatus') {
                messages.push({ type: message.type, status: message.task.status });
            } else if (message.type === 'result') {
                messages.push({ type: message.type, result: message.result });
            } else {
                messages.push({ type: message.type, error: describe(message.error) });
            }
        }
        const afterwards = await tasks.getTask(holdId);
        return {
            messages,
            cancelled,
            statusAfterwards: afterwards.status,
            cancelledOnServer: await counterAfter(client, 'cancelled_holds', before)
        };
    });
    await step(results, 'cancelAgain', () => tasks.cancelTask(holdId));
    await step(results, 'unknownTask', () => tasks.getTask('no-such-task'));
    await step(results, 'listTasks', async () => {
        const listed = await tasks.listTasks();
        const names = { [reportId]: 'report', [holdId]: 'hold' };
        return {
            tasks: listed.tasks.map(task => ({ task: names[task.taskId] ?? task.taskId, status: task.status })),
            nextCursor: listed.nextCursor ?? null
        };
    });
    results.clientErrors = errors.slice();
    await close();
}

let code = 0;
for (const [name, run] of [['plain', plainClient], ['tasks', tasksClient]]) {
    try {
        await run();
    } catch (error) {
        output[name] = { ...(output[name] ?? {}), fatal: describe(error) };
        code = 1;
    }
}
clearTimeout(watchdog);
emit(code);
