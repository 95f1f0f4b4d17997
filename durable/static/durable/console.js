/* The console's only script: opt-in auto-refresh that pauses while the tab is hidden,
   and a confirmation before destructive buttons. Pages work without it. */
(function () {
  "use strict";

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-confirm]");
    if (button && !window.confirm(button.getAttribute("data-confirm"))) {
      event.preventDefault();
    }
  });

  var box = document.getElementById("durable-autorefresh");
  if (!box) {
    return;
  }
  var KEY = "durable.autorefresh";
  var seconds = parseInt(box.getAttribute("data-seconds"), 10) || 30;
  var state = document.getElementById("durable-refresh-state");
  var timer = null;
  var due = 0;

  function say(text) {
    if (state) {
      state.textContent = text;
    }
  }

  function schedule() {
    window.clearTimeout(timer);
    timer = null;
    if (!box.checked) {
      say("");
      return;
    }
    if (document.hidden) {
      say("paused while this tab is hidden");
      return;
    }
    var wait = due ? Math.max(due - Date.now(), 0) : seconds * 1000;
    due = Date.now() + wait;
    say("");
    timer = window.setTimeout(function () { window.location.reload(); }, wait);
  }

  try {
    box.checked = window.localStorage.getItem(KEY) === "1";
  } catch (e) {
    box.checked = false;
  }
  box.addEventListener("change", function () {
    try {
      window.localStorage.setItem(KEY, box.checked ? "1" : "0");
    } catch (e) { /* private mode: the choice lasts for this page only */ }
    due = 0;
    schedule();
  });
  document.addEventListener("visibilitychange", schedule);
  schedule();
}());
