// The chat page: streams each answer from /v1/chat/completions (server-sent events), renders it
// as Markdown (marked, then DOMPurify: the model's text never reaches the page unsanitized) and
// shows its numbers. Stop aborts the fetch, which closes the connection: the server then aborts
// the request and frees its KV blocks.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const messagesBox = $("messages"), promptBox = $("prompt"), sendButton = $("send"), stopButton = $("stop");
  let history = [];  // {role, content} of the conversation so far, without the system prompt
  let model = null;
  let running = null;  // the AbortController of the answer being streamed

  // Markdown to safe HTML: marked renders (GitHub flavour), DOMPurify removes scripts, event
  // handlers, javascript: links and the like. Links open in a new tab, keeping the chat.
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  function renderMarkdown(text) {
    return DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: false }));
  }
  window.renderMarkdown = renderMarkdown;  // for the tests, which check the sanitizing

  async function loadModel() {
    const response = await tuili.call("v1/models");
    if (!response.ok) throw new Error(await tuili.errorText(response));
    model = (await response.json()).data[0].id;
    $("model-name").textContent = model;
  }

  function addMessage(role, text) {
    const box = document.createElement("div");
    box.className = "message " + role;
    const body = document.createElement("div");
    body.className = "body";
    if (role === "user") body.textContent = text; else body.innerHTML = renderMarkdown(text);
    box.appendChild(body);
    messagesBox.appendChild(box);
    box.scrollIntoView({ block: "end" });
    return box;
  }

  function showNumbers(box, numbers) {
    const line = document.createElement("div");
    line.className = "numbers";
    const parts = [];
    for (const [name, value, text] of numbers) {
      if (value === null || value === undefined) continue;
      line.dataset[name] = String(value);
      parts.push(text);
    }
    line.textContent = parts.join(" · ");
    box.appendChild(line);
  }

  // Server-sent events: yields each `data:` payload parsed, until [DONE].
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          yield JSON.parse(data);
        }
      }
    }
  }

  async function ask(text) {
    const system = $("system-prompt").value.trim();
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const box = addMessage("assistant", "");
    box.classList.add("streaming");
    const body = box.querySelector(".body");
    const request = {
      model, stream: true, stream_options: { include_usage: true },
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      temperature: Number($("temperature").value),
    };
    if ($("max-tokens").value) request.max_tokens = Number($("max-tokens").value);  // else up to the context
    running = new AbortController();
    sendButton.hidden = true;
    stopButton.hidden = false;
    const sent = performance.now();
    let answer = "", first = null, last = null, usage = null, finish = null, pending = false;
    const render = () => {
      pending = false;
      body.innerHTML = renderMarkdown(answer);
      box.dataset.raw = answer;
      box.scrollIntoView({ block: "end" });
    };
    try {
      const response = await tuili.call("v1/chat/completions", {
        method: "POST", body: JSON.stringify(request), signal: running.signal,
      });
      if (!response.ok) throw new Error(await tuili.errorText(response));
      for await (const chunk of events(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.finish_reason) finish = choice.finish_reason;
        const delta = choice.delta && choice.delta.content;
        if (!delta) continue;
        last = performance.now();
        if (first === null) first = last;
        answer += delta;
        if (!pending) { pending = true; requestAnimationFrame(render); }
      }
    } catch (error) {
      if (error.name === "AbortError") finish = "stopped";
      else {
        const note = document.createElement("div");
        note.className = "error";
        note.textContent = error.message;
        box.appendChild(note);
      }
    } finally {
      running = null;
      stopButton.hidden = true;
      sendButton.hidden = false;
    }
    render();
    box.classList.remove("streaming");
    box.dataset.finish = finish || "";
    if (answer) history.push({ role: "assistant", content: answer });
    const generated = usage ? usage.completion_tokens : null;
    const details = usage && usage.prompt_tokens_details;
    showNumbers(box, [
      ["ttft", first === null ? null : (first - sent) / 1000, first === null ? "" : `TTFT ${((first - sent) / 1000).toFixed(2)} s`],
      ["tokensPerSecond", generated > 1 && last > first ? (generated - 1) / ((last - first) / 1000) : null,
        generated > 1 && last > first ? `${((generated - 1) / ((last - first) / 1000)).toFixed(1)} tok/s` : ""],
      ["completionTokens", generated, `${generated} tokens`],
      ["promptTokens", usage ? usage.prompt_tokens : null, usage ? `prompt ${usage.prompt_tokens}` : ""],
      ["cachedTokens", details ? details.cached_tokens : null, details ? `cached ${details.cached_tokens}` : ""],
      ["finish", finish, finish ? `(${finish})` : ""],
    ]);
  }

  $("prompt-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = promptBox.value.trim();
    if (!text || running) return;
    promptBox.value = "";
    ask(text);
  });
  promptBox.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("prompt-form").requestSubmit();
    }
  });
  stopButton.addEventListener("click", () => { if (running) running.abort(); });
  $("new-chat").addEventListener("click", () => {
    if (running) running.abort();
    history = [];
    messagesBox.replaceChildren();
    promptBox.focus();
  });

  // The settings outlive the tab (they are not secret; the key is kept only for the tab).
  for (const id of ["system-prompt", "temperature", "max-tokens"]) {
    const saved = localStorage.getItem("tuili-chat-" + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("input", () => localStorage.setItem("tuili-chat-" + id, $(id).value));
  }

  loadModel().catch((error) => { $("model-name").textContent = "error: " + error.message; });
})();
