// Built into dist/ and served by the gateway at /admin (gateway/admin_ui.py).
// `npm run dev`: http://127.0.0.1:5173/admin/ with the API proxied to the gateway
// (SPARKGATE_URL, default http://127.0.0.1:8000).
import { defineConfig } from "vite";

declare const process: { env: Record<string, string | undefined> }; // no @types/node needed
const gateway = process.env.SPARKGATE_URL ?? "http://127.0.0.1:8000";

export default defineConfig({
  base: "/admin/",
  publicDir: false,
  build: {
    outDir: "dist",
    emptyOutDir: true,
    target: "es2022",
    sourcemap: false,
    chunkSizeWarningLimit: 400,
  },
  server: {
    host: "127.0.0.1",
    proxy: {
      "/admin/v1": { target: gateway, changeOrigin: true },
      "/v1": { target: gateway, changeOrigin: true },
    },
  },
});
