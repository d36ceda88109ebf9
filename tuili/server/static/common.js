// Shared by the chat and dashboard pages: the API key, kept in this tab's sessionStorage, and
// fetch with it. Every URL is relative, so the pages work under a path prefix (--root-path).
"use strict";

const tuili = (() => {
  const KEY_NAME = "tuili-api-key";
  const keyForm = document.getElementById("key-form");
  const keyInput = document.getElementById("key-input");
  let keyWaiters = [];

  function headers(json) {
    const h = json ? { "Content-Type": "application/json" } : {};
    const key = sessionStorage.getItem(KEY_NAME);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  // The server answered 401: show the key field and wait until the user gives one.
  function askForKey(message) {
    keyForm.hidden = false;
    keyForm.querySelector(".key-message").textContent = message;
    keyInput.focus();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_NAME, keyInput.value);
    keyInput.value = "";
    keyForm.hidden = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
  });

  // fetch(path) with the key; on 401 ask for the key and try again. Other answers are returned.
  async function call(path, options = {}) {
    for (;;) {
      const response = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
      if (response.status !== 401) return response;
      let message = "this server needs its API key";
      try { message = (await response.json()).error.message; } catch (_) { /* keep the default */ }
      await askForKey(message);
    }
  }

  // The message of an OpenAI-style error response, else its status.
  async function errorText(response) {
    try {
      const body = await response.json();
      return body.error && body.error.message ? body.error.message : JSON.stringify(body);
    } catch (_) {
      return `HTTP ${response.status}`;
    }
  }

  return { call, errorText };
})();
