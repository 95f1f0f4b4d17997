/* The console's only script: opt-in auto-refresh that pauses while the tab is hidden,
   a confirmation before destructive buttons, and a warning on a signal nobody reads.
   Pages work without it. */
(function () {
  "use strict";

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-confirm]");
    if (button && !window.confirm(button.getAttribute("data-confirm"))) {
      event.preventDefault();
    }
  });

  /* A signal name no open wait of the job reads: say so while it is typed, and ask
     before it is delivered (the server says so again after). */
  Array.prototype.forEach.call(document.querySelectorAll("input[data-waited]"), function (input) {
    var waited = input.getAttribute("data-waited").split("|").filter(Boolean);
    var warning = document.getElementById(input.getAttribute("aria-describedby"));
    var button = input.form && input.form.querySelector("button[type=submit]");
    function check() {
      var name = input.value.trim();
      var unread = name !== "" && waited.indexOf(name) < 0;
      var text = "";
      if (unread) {
        text = waited.length
          ? "No wait of this job reads \u201c" + name + "\u201d: it waits for \u201c" +
            waited.join("\u201d, \u201c") + "\u201d. Delivered, it stays unread."
          : "This job waits for no signal now: \u201c" + name + "\u201d would stay unread.";
      }
      if (warning) {
        warning.textContent = text;
        warning.hidden = !unread;
      }
      if (button) {
        if (unread) {
          button.setAttribute("data-confirm", text + " Deliver it anyway?");
        } else {
          button.removeAttribute("data-confirm");
        }
      }
    }
    input.addEventListener("input", check);
    check();
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
