// Sparkgate admin UI: a hash-routed single page app served at /admin.

import "./style.css";
import { clearToken, getToken, setAuthErrorHandler, authMessage } from "./api";
import { clear, h } from "./dom";
import { renderLogin } from "./pages/login";
import { renderOverview } from "./pages/overview";
import { renderUsers } from "./pages/users";
import { renderUser } from "./pages/user";
import { renderAcceptance } from "./pages/acceptance";
import { renderTiers } from "./pages/tiers";
import { renderTenants } from "./pages/tenants";

export interface Ctx {
  params: URLSearchParams;
  /** Change query parameters of the current page (re-renders it). */
  go(route: string, params?: Record<string, string | null | undefined>): void;
  /** Register cleanup (timers, charts) for when the page is left. */
  onLeave(fn: () => void): void;
}

type Render = (ctx: Ctx) => Promise<HTMLElement> | HTMLElement;

const ROUTES: Record<string, { title: string; render: Render; nav?: string }> = {
  overview: { title: "Overview", render: renderOverview, nav: "Overview" },
  users: { title: "Users", render: renderUsers, nav: "Users" },
  user: { title: "User", render: renderUser },
  acceptance: { title: "Acceptance", render: renderAcceptance, nav: "Acceptance" },
  tiers: { title: "SLA tiers", render: renderTiers, nav: "SLA tiers" },
  tenants: { title: "Tenants & keys", render: renderTenants, nav: "Tenants & keys" },
};

let flash: string | null = null;
let leaving: (() => void)[] = [];
let renderSeq = 0;

function parseHash(): { route: string; params: URLSearchParams } {
  const raw = location.hash.replace(/^#\/?/, "");
  const [route, query] = raw.split("?", 2);
  return { route: route || "overview", params: new URLSearchParams(query ?? "") };
}

export function go(route: string, params: Record<string, string | null | undefined> = {}): void {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, v);
  const qs = q.toString();
  const hash = `#/${route}${qs ? "?" + qs : ""}`;
  if (location.hash === hash) void render();
  else location.hash = hash;
}

export function signOut(message: string | null = null): void {
  clearToken();
  flash = message;
  go("login");
}

setAuthErrorHandler((status) => signOut(authMessage(status)));

const app = document.getElementById("app") as HTMLElement;

function shell(active: string, content: HTMLElement): HTMLElement {
  const main = h("main", { id: "main", tabindex: "-1" }, content);
  const skip = h("a", { class: "skip-link", href: "#main" }, "Skip to content");
  skip.addEventListener("click", (e) => {
    e.preventDefault();
    main.focus();
  });
  const nav = h("nav", { "aria-label": "Admin pages" },
    h("ul", {}, Object.entries(ROUTES).filter(([, r]) => r.nav).map(([name, r]) =>
      h("li", {}, h("a", { href: `#/${name}`, "aria-current": name === active || (active === "user" && name === "users") ? "page" : null }, r.nav!)))));
  const out = h("button", { type: "button", class: "link", onclick: () => signOut("Signed out.") }, "Sign out");
  return h("div", { class: "layout" },
    skip,
    h("header", { class: "top" }, h("div", { class: "brand" }, h("span", { class: "logo", "aria-hidden": "true" }, "⚡"),
      "Sparkgate", h("span", { class: "brand-sub" }, "admin")), nav, out),
    main);
}

async function render(): Promise<void> {
  const seq = ++renderSeq;
  for (const fn of leaving) fn();
  leaving = [];
  const { route, params } = parseHash();
  // A page that registers cleanup after it was already left (its first requests were still in
  // flight when the route changed) gets it run at once: no timer outlives its page.
  const ctx: Ctx = { params, go, onLeave: (fn) => (seq === renderSeq ? leaving.push(fn) : fn()) };
  if (route === "login" || !getToken()) {
    const message = flash;
    flash = null;
    clear(app);
    document.title = "Sign in · Sparkgate admin";
    app.appendChild(renderLogin(message, () => go("overview")));
    if (route !== "login") history.replaceState(null, "", "#/login");
    (app.querySelector("input") as HTMLInputElement | null)?.focus();
    return;
  }
  const r = ROUTES[route] ?? ROUTES.overview;
  document.title = `${r.title} · Sparkgate admin`;
  const placeholder = h("p", { class: "loading" }, "Loading…");
  clear(app);
  app.appendChild(shell(route, placeholder));
  try {
    const page = await r.render(ctx);
    if (seq !== renderSeq) return;
    placeholder.replaceWith(page);
  } catch (e) {
    if (seq !== renderSeq) return;
    placeholder.replaceWith(h("p", { class: "message error", role: "alert" }, `This page could not load: ${(e as Error).message}`));
  }
}

window.addEventListener("hashchange", () => void render());
void render();
