// The playground: a chat page for the server that serves it.
// Plain browser JavaScript, no build step; it talks only to its own origin
// (the page's Content-Security-Policy allows nothing else).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"),
    newChat: $("new-chat"),
    keyBox: $("key-box"),
    keyForm: $("key-form"),
    key: $("api-key"),
    system: $("system"),
    maxTokens: $("max-tokens"),
    temperature: $("temperature"),
    tools: $("tools"),
    messages: $("messages"),
    empty: $("empty"),
    status: $("status"),
    attachments: $("attachments"),
    sendForm: $("send-form"),
    file: $("file"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
    drop: $("drop"),
  };

  // The conversation as sent to the server: earlier turns, oldest first.
  const history = [];
  // Files attached to the next message: {kind, name, url, preview}; an
  // audio file also keeps its format and its bytes in base64 (input_audio).
  let attachments = [];
  // Each chat model's input_modalities, from /v1/models (null: not loaded).
  let modalities = new Map();
  // The running request's AbortController; null while idle.
  let running = null;
  // Counts "New chat"s: an answer that ends after one is not kept.
  let conversation = 0;
  let apiKey = sessionStorage.getItem("mlx-pinned-key") || "";

  class APIError extends Error {
    constructor(message, status) {
      super(message);
      this.status = status;
    }
  }

  function element(tag, className, text) {
    const made = document.createElement(tag);
    if (className) made.className = className;
    if (text !== undefined) made.textContent = text;
    return made;
  }

  function headers(extra) {
    const all = Object.assign({}, extra);
    if (apiKey) all.Authorization = "Bearer " + apiKey;
    return all;
  }

  function setStatus(text, isError) {
    ui.status.textContent = text || "";
    ui.status.classList.toggle("error", Boolean(isError));
  }

  // The message of an error answer in OpenAI's shape, or the status line.
  async function errorOf(response) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (ignored) {
      // not JSON: the status line says enough
    }
    return new APIError(message, response.status);
  }

  function needKey(message) {
    ui.keyBox.hidden = false;
    setStatus(message || "This server needs an API key.", true);
    ui.key.focus();
  }

  // ---- models -------------------------------------------------------------

  async function loadModels() {
    ui.model.disabled = true;
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (error) {
      setStatus("Cannot reach the server: " + error.message, true);
      return;
    }
    if (response.status === 401) {
      needKey((await errorOf(response)).message);
      return;
    }
    if (!response.ok) {
      setStatus("Listing the models failed: " + (await errorOf(response)).message, true);
      return;
    }
    // The chat models only: an embedding model or a reranker has no chat.
    const cards = (await response.json()).data || [];
    const listed = cards.filter((card) => (card.kind || "chat") === "chat");
    modalities = new Map(listed.map((card) => [card.id, card.input_modalities]));
    const previous = ui.model.value || sessionStorage.getItem("mlx-pinned-model");
    ui.model.replaceChildren(
      ...listed.map((card) => {
        const option = element("option", "", card.id);
        option.value = card.id;
        return option;
      }),
    );
    if (listed.some((card) => card.id === previous)) ui.model.value = previous;
    ui.model.disabled = listed.length === 0;
    if (apiKey) ui.keyBox.hidden = true;
    setStatus(listed.length ? "" : "The server serves no model.", !listed.length);
  }

  ui.model.addEventListener("change", () => {
    sessionStorage.setItem("mlx-pinned-model", ui.model.value);
  });

  ui.keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = ui.key.value.trim();
    sessionStorage.setItem("mlx-pinned-key", apiKey);
    loadModels();
  });

  // ---- attachments --------------------------------------------------------

  function readAsDataURL(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  // OpenAI's input_audio formats, by the MIME types browsers give them.
  const AUDIO_FORMATS = {
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/wave": "wav",
    "audio/vnd.wave": "wav",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
  };

  // Whether the chosen model takes audio: its /v1/models card says so once
  // it is loaded; before that (null) the server's answer tells.
  function takesAudio() {
    const taken = modalities.get(ui.model.value);
    return !Array.isArray(taken) || taken.includes("audio");
  }

  async function attach(files) {
    for (const file of files) {
      const kind = file.type.split("/")[0];
      if (kind !== "image" && kind !== "video" && kind !== "audio") {
        setStatus(file.name + ": only images, videos and audio can be attached.", true);
        continue;
      }
      const format = AUDIO_FORMATS[file.type];
      if (kind === "audio" && !format) {
        setStatus(file.name + ": audio is sent as WAV or MP3.", true);
        continue;
      }
      if (kind === "audio" && !takesAudio()) {
        setStatus(ui.model.value + " takes no audio: choose a model that does.", true);
        continue;
      }
      try {
        const url = await readAsDataURL(file);
        const item = { kind, name: file.name, url, preview: URL.createObjectURL(file) };
        if (kind === "audio") {
          item.format = format;
          item.data = url.slice(url.indexOf(",") + 1);
        }
        attachments.push(item);
      } catch (error) {
        setStatus("Could not read " + file.name + ": " + error.message, true);
      }
    }
    showAttachments();
  }

  function mediaOf(item, className) {
    const tag = { video: "video", audio: "audio" }[item.kind] || "img";
    const media = element(tag, className);
    media.src = item.preview || item.url;
    if (item.kind === "audio") {
      media.controls = true;
      media.preload = "metadata";
      media.title = item.name;
    } else if (item.kind === "video") {
      media.controls = true;
      media.muted = true;
      media.preload = "metadata";
    } else {
      media.alt = item.name;
    }
    return media;
  }

  function showAttachments() {
    ui.attachments.replaceChildren(
      ...attachments.map((item, index) => {
        const entry = element("li", "attachment");
        entry.append(mediaOf(item, "thumb"));
        const remove = element("button", "remove", "×");
        remove.type = "button";
        remove.title = "Remove " + item.name;
        remove.addEventListener("click", () => {
          URL.revokeObjectURL(item.preview);
          attachments.splice(index, 1);
          showAttachments();
        });
        entry.append(remove);
        return entry;
      }),
    );
  }

  ui.file.addEventListener("change", () => {
    attach(Array.from(ui.file.files));
    ui.file.value = "";
  });

  ui.prompt.addEventListener("paste", (event) => {
    const files = Array.from(event.clipboardData ? event.clipboardData.files : []);
    if (files.length) {
      event.preventDefault();
      attach(files);
    }
  });

  let dragDepth = 0;
  const dragsFiles = (event) =>
    event.dataTransfer && Array.from(event.dataTransfer.types).includes("Files");
  document.addEventListener("dragenter", (event) => {
    if (!dragsFiles(event)) return;
    dragDepth += 1;
    ui.drop.hidden = false;
  });
  document.addEventListener("dragleave", () => {
    dragDepth = Math.max(0, dragDepth - 1);
    if (dragDepth === 0) ui.drop.hidden = true;
  });
  document.addEventListener("dragover", (event) => {
    if (dragsFiles(event)) event.preventDefault();
  });
  document.addEventListener("drop", (event) => {
    if (!dragsFiles(event)) return;
    event.preventDefault();
    dragDepth = 0;
    ui.drop.hidden = true;
    attach(Array.from(event.dataTransfer.files));
  });

  // ---- the conversation ---------------------------------------------------

  function nearBottom() {
    const page = document.scrollingElement;
    return page.scrollHeight - page.scrollTop - page.clientHeight < 80;
  }

  function follow(wasNearBottom) {
    if (wasNearBottom) window.scrollTo(0, document.scrollingElement.scrollHeight);
  }

  function showUserTurn(text, files) {
    ui.empty.hidden = true;
    const turn = element("article", "turn user");
    if (files.length) {
      const strip = element("div", "media");
      files.forEach((item) => strip.append(mediaOf(item, "shown")));
      turn.append(strip);
    }
    if (text) turn.append(element("div", "text", text));
    ui.messages.append(turn);
    follow(true);
  }

  // An answer's view: its text, folded reasoning, tool calls and numbers.
  function answerView(model) {
    const turn = element("article", "turn assistant");
    const who = element("div", "who", model);
    turn.append(who);
    const reasoning = element("details", "reasoning");
    reasoning.hidden = true;
    reasoning.append(element("summary", "", "Reasoning"));
    const thought = element("div", "reasoning-text");
    reasoning.append(thought);
    const text = element("div", "text answer-text");
    const tools = element("div", "tool-calls");
    const stats = element("div", "stats");
    turn.append(reasoning, text, tools, stats);
    ui.messages.append(turn);
    follow(true);
    return { turn, who, reasoning, thought, text, tools, stats };
  }

  function showToolCalls(view, calls) {
    view.tools.replaceChildren(
      ...calls.map((call) => {
        const box = element("div", "tool-call");
        box.append(element("div", "tool-name", "tool call: " + (call.function.name || "…")));
        box.append(element("pre", "tool-arguments", call.function.arguments));
        return box;
      }),
    );
  }

  // Reads the server-sent events of a streamed completion, one JSON each.
  async function readEvents(response, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }

  function numberField(input) {
    const value = input.value.trim();
    return value === "" ? undefined : Number(value);
  }

  function requestBody(messages) {
    const body = {
      model: ui.model.value,
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const maxTokens = numberField(ui.maxTokens);
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    const temperature = numberField(ui.temperature);
    if (temperature !== undefined) body.temperature = temperature;
    const tools = ui.tools.value.trim();
    if (tools) {
      const parsed = JSON.parse(tools);
      if (!Array.isArray(parsed)) throw new Error("Tools must be a JSON array.");
      if (parsed.length) body.tools = parsed;
    }
    return body;
  }

  function userContent(text, files) {
    if (!files.length) return text;
    const parts = [];
    if (text) parts.push({ type: "text", text });
    for (const item of files) {
      if (item.kind === "video") {
        parts.push({ type: "video_url", video_url: { url: item.url } });
      } else if (item.kind === "audio") {
        parts.push({ type: "input_audio", input_audio: { data: item.data, format: item.format } });
      } else {
        parts.push({ type: "image_url", image_url: { url: item.url } });
      }
    }
    return parts;
  }

  function statsText(answer, finished) {
    const parts = [];
    const usage = answer.usage;
    const decoding = answer.firstAt ? (finished - answer.firstAt) / 1000 : 0;
    if (usage) {
      parts.push(usage.completion_tokens + " tokens");
      if (decoding > 0 && usage.completion_tokens > 1) {
        parts.push(((usage.completion_tokens - 1) / decoding).toFixed(1) + " tokens/s");
      }
      parts.push(usage.prompt_tokens + " prompt tokens");
    } else {
      parts.push(answer.pieces + " pieces");
    }
    if (answer.firstAt) {
      parts.push("first token " + Math.round(answer.firstAt - answer.startedAt) + " ms");
    }
    if (answer.finishReason) parts.push(answer.finishReason);
    return parts.join(" · ");
  }

  function setRunning(controller) {
    running = controller;
    ui.send.hidden = Boolean(controller);
    ui.stop.hidden = !controller;
    ui.model.disabled = Boolean(controller);
  }

  async function send() {
    const text = ui.prompt.value.trim();
    if (running || (!text && !attachments.length)) return;
    if (!ui.model.value) {
      setStatus("Pick a model first.", true);
      return;
    }
    let body;
    const user = { role: "user", content: userContent(text, attachments) };
    const system = ui.system.value.trim();
    const messages = system ? [{ role: "system", content: system }] : [];
    try {
      body = requestBody(messages.concat(history, [user]));
    } catch (error) {
      setStatus(error.message, true);
      return;
    }
    setStatus("");
    showUserTurn(text, attachments);
    ui.prompt.value = "";
    attachments = [];
    showAttachments();

    const view = answerView(body.model);
    const answer = {
      content: "",
      reasoning: "",
      calls: [],
      usage: null,
      finishReason: "",
      pieces: 0,
      startedAt: performance.now(),
      firstAt: 0,
    };
    const controller = new AbortController();
    const mine = conversation;
    setRunning(controller);
    let ending = "";
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw await errorOf(response);
      await readEvents(response, (event) => {
        if (event.error) throw new APIError(event.error.message, 0);
        if (event.usage) answer.usage = event.usage;
        // The model that answers, as the server names it.
        if (event.model) view.who.textContent = event.model;
        const choice = (event.choices || [])[0];
        if (!choice) return;
        const delta = choice.delta || {};
        const wasNearBottom = nearBottom();
        const thought = delta.reasoning_content || delta.reasoning;
        if (delta.content || thought || delta.tool_calls) {
          answer.pieces += 1;
          if (!answer.firstAt) answer.firstAt = performance.now();
        }
        if (thought) {
          answer.reasoning += thought;
          view.reasoning.hidden = false;
          view.thought.textContent = answer.reasoning;
        }
        if (delta.content) {
          answer.content += delta.content;
          view.text.textContent = answer.content;
        }
        for (const part of delta.tool_calls || []) {
          const index = part.index || 0;
          const call = (answer.calls[index] = answer.calls[index] || {
            id: "",
            type: "function",
            function: { name: "", arguments: "" },
          });
          if (part.id) call.id = part.id;
          if (part.function && part.function.name) call.function.name += part.function.name;
          if (part.function && part.function.arguments) {
            call.function.arguments += part.function.arguments;
          }
          showToolCalls(view, answer.calls);
        }
        if (choice.finish_reason) answer.finishReason = choice.finish_reason;
        follow(wasNearBottom);
      });
    } catch (error) {
      if (error.name === "AbortError") {
        ending = "stopped";
      } else {
        controller.abort(); // an error event mid-stream: close the connection
        view.turn.classList.add("failed");
        view.text.append(element("div", "error", error.message));
        if (error.status === 401) needKey(error.message);
        setRunning(null);
        return;
      }
    }
    setRunning(null);
    const finished = performance.now();
    view.stats.textContent = statsText(answer, finished) + (ending ? " · " + ending : "");
    const reply = { role: "assistant", content: answer.content };
    const calls = answer.calls.filter(Boolean);
    if (calls.length) reply.tool_calls = calls;
    // A turn stopped before any answer is left out of the conversation.
    if (mine === conversation && (answer.content || calls.length)) {
      history.push(user, reply);
    }
  }

  ui.sendForm.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });

  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });

  ui.stop.addEventListener("click", () => {
    if (running) running.abort();
  });

  ui.newChat.addEventListener("click", () => {
    if (running) running.abort();
    conversation += 1;
    history.length = 0;
    ui.messages.replaceChildren(ui.empty);
    ui.empty.hidden = false;
    setStatus("");
  });

  if (apiKey) ui.key.value = apiKey;
  loadModels();
})();
