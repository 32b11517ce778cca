/* Filters only: the page reads the same without this script (its CSP allows nothing else).
   It adds a form above the results: which states to show, and a text that a backend,
   clause or test id must contain; the grid's rows follow the text. */
(function () {
  "use strict";
  var slot = document.getElementById("filter-slot");
  if (!slot) { return; }
  var states = JSON.parse(slot.getAttribute("data-states"));
  var form = document.createElement("form");
  form.className = "filters";
  form.setAttribute("role", "search");
  form.setAttribute("aria-label", "Filter the results");
  var boxes = {};
  var title = document.createElement("strong");
  title.textContent = "Show:";
  form.appendChild(title);
  states.forEach(function (s) {
    var label = document.createElement("label");
    var box = document.createElement("input");
    box.type = "checkbox";
    box.checked = true;
    box.name = "state-" + s[0];
    boxes[s[0]] = box;
    label.appendChild(box);
    label.appendChild(document.createTextNode(s[1] + " " + s[2]));
    form.appendChild(label);
  });
  var textLabel = document.createElement("label");
  textLabel.textContent = "containing ";
  var text = document.createElement("input");
  text.type = "search";
  text.name = "text";
  text.placeholder = "backend, clause or test id";
  textLabel.appendChild(text);
  form.appendChild(textLabel);
  var shown = document.createElement("span");
  shown.setAttribute("role", "status");
  form.appendChild(shown);
  form.addEventListener("submit", function (e) { e.preventDefault(); });
  slot.appendChild(form);

  function apply() {
    var needle = text.value.trim().toLowerCase();
    var count = 0;
    document.querySelectorAll(".group").forEach(function (group) {
      var any = false;
      group.querySelectorAll(".result").forEach(function (r) {
        var body = r.querySelector(".body");
        var key = (group.id + " " + (r.id || (body ? body.id : ""))).toLowerCase();
        var show = boxes[r.getAttribute("data-state")].checked && key.indexOf(needle) >= 0;
        r.hidden = !show;
        if (show) { any = true; count += 1; }
      });
      group.hidden = !any;
    });
    document.querySelectorAll("table.grid tbody tr[data-row]").forEach(function (tr) {
      tr.hidden = needle !== "" && tr.getAttribute("data-row").toLowerCase().indexOf(needle) < 0;
    });
    shown.textContent = count + " shown";
  }
  form.addEventListener("input", apply);
  form.addEventListener("change", apply);
})();
