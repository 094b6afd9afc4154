// The Vercel AI SDK (`ai` with `@ai-sdk/openai`'s chat-completions model) against a live
// Sparkgate server: `generateObject` with a zod schema, then `streamText` with a tool (a call
// forced on the first step, a free-text answer on the second). Prints one JSON object on stdout:
// {object, streamText (its steps and errors), requests}; `requests` are the JSON bodies the SDK sent, in order.
// Env: OPENAI_BASE_URL (the server's /v1 base URL), OPENAI_API_KEY (a Sparkgate key), MODEL.
// Run by tests/gateway/clients/test_vercel_ai_sdk.py, which asserts on the output.
import { createOpenAI } from "@ai-sdk/openai";
import { generateObject, stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

const description = "Get the current weather in a city."; // weather.py's DESCRIPTION
const weatherReport = (city) => `The weather in ${city} is sunny and 18 degrees.`; // weather.py's weather_report

const requests = [];
const recordingFetch = async (url, init) => {
  if (init && typeof init.body === "string") requests.push({ url: String(url), body: JSON.parse(init.body) });
  return fetch(url, init);
};
const provider = createOpenAI({
  baseURL: process.env.OPENAI_BASE_URL,
  apiKey: process.env.OPENAI_API_KEY,
  fetch: recordingFetch,
});
const model = provider.chat(process.env.MODEL); // /v1/chat/completions (provider(...) is /v1/responses)

const object = await generateObject({
  model,
  // z.tuple is a draft-07 tuple on the wire (an array-valued "items")
  schema: z.object({
    city: z.string().max(30),
    country: z.string().max(30),
    coordinates: z.tuple([z.number().int().min(-90).max(90), z.number().int().min(-180).max(180)]),
  }),
  prompt: "Tell me about Paris as JSON.",
  temperature: 0,
  maxOutputTokens: 64,
  maxRetries: 0,
});

const toolInputs = [];
const streamErrors = []; // streamText reports errors (an HTTP 400, say) here instead of throwing
const result = streamText({
  model,
  tools: {
    get_weather: tool({
      description,
      inputSchema: z.object({ city: z.string().max(30) }),
      execute: async ({ city }) => {
        toolInputs.push({ city });
        return weatherReport(city);
      },
    }),
  },
  // The 135M model is weak: force the call on the first step, let it answer freely on the second.
  prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "auto" }),
  stopWhen: stepCountIs(2),
  prompt: "What is the weather in Paris?",
  temperature: 0,
  maxOutputTokens: 64,
  maxRetries: 0,
  onError: ({ error }) => streamErrors.push(String(error)),
});
const textDeltas = [];
for await (const delta of result.textStream) textDeltas.push(delta);
const steps = await result.steps;

console.log(JSON.stringify({
  object: { object: object.object, finishReason: object.finishReason },
  streamText: {
    text: await result.text,
    textDeltas: textDeltas.length,
    finishReason: await result.finishReason,
    toolInputs,
    errors: streamErrors,
    steps: steps.map((s) => ({
      finishReason: s.finishReason,
      text: s.text,
      toolCalls: s.toolCalls.map((c) => ({ toolCallId: c.toolCallId, toolName: c.toolName, input: c.input })),
      toolResults: s.toolResults.map((r) => ({ toolCallId: r.toolCallId, output: r.output })),
    })),
  },
  requests,
}));
