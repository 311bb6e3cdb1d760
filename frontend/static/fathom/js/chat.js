// Streams a chat completion from the deployment's chat endpoint: an OpenAI chat completions
// body with `"stream": true`, answered as server-sent events (`data: {...}` … `data: [DONE]`),
// read with fetch and a stream reader (EventSource cannot POST).

import { ApiError, csrfToken } from "./api.js";

/**
 * Calls `onDelta(text)` for each piece of the answer as it arrives; resolves with
 * `{text, finishReason, usage}` when the stream ends. Abort with `signal`.
 */
export async function streamChat(path, body, { onDelta, signal }) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream", "X-CSRFToken": csrfToken() },
    body: JSON.stringify({ ...body, stream: true }),
    credentials: "same-origin",
    signal,
  });
  if (!response.ok) throw new ApiError(response.status, await errorBody(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let text = "";
  let finishReason = null;
  let usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    // Events end with a blank line; a chunk may hold several events or part of one.
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const raw = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = raw
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return { text, finishReason, usage };
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(response.status, chunk);
      const choice = chunk.choices?.[0];
      const piece = choice?.delta?.content;
      if (piece) {
        text += piece;
        onDelta(piece);
      }
      finishReason = choice?.finish_reason ?? finishReason;
      usage = chunk.usage ?? usage;
    }
  }
  return { text, finishReason, usage };
}

async function errorBody(response) {
  const text = await response.text();
  try {
    const data = JSON.parse(text);
    // OpenAI's shape, {"error": {"message": ...}}, read as the API's {"detail": ...}.
    if (data?.error?.message) return { detail: data.error.message, code: data.error.code ?? null };
    return data;
  } catch {
    return text;
  }
}
