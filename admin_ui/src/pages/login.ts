import { ApiError, authMessage, request, setToken } from "../api";
import { h } from "../dom";
import { field, messageBox } from "../ui";

/** Sign in with the admin token: checked against /admin/v1/tiers before it is kept. */
export function renderLogin(message: string | null, done: () => void): HTMLElement {
  const token = field({ name: "token", label: "Admin token", type: "password", autocomplete: "current-password",
    required: true, hint: "The gateway's SPARKGATE_ADMIN_TOKEN. Tenant API keys are refused." });
  const msg = messageBox();
  if (message) msg.error(message);
  const submit = h("button", { type: "submit", class: "primary" }, "Sign in");
  const form = h("form", { class: "login-form", "aria-labelledby": "login-title", novalidate: true },
    h("h1", { id: "login-title" }, "Sparkgate admin"),
    h("p", { class: "muted" }, "Sign in to see live load, users, acceptance and SLA attainment."),
    token.wrap, msg.el, submit);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const value = token.value();
    token.setError(null);
    if (!value) {
      token.setError("Enter the admin token.");
      token.input.focus();
      return;
    }
    submit.setAttribute("disabled", "");
    msg.clear();
    try {
      await request("GET", "/admin/v1/tiers", undefined, value);
      setToken(value);
      done();
    } catch (err) {
      const e2 = err as ApiError;
      msg.error(e2.status === 401 || e2.status === 403 ? authMessage(e2.status) : e2.message);
      token.input.focus();
    } finally {
      submit.removeAttribute("disabled");
    }
  });
  return h("div", { class: "login" }, form);
}
