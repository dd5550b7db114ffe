-- wrk script for benchmarks/bench_http.py: POST one file as multipart/form-data, and print the summary as JSON.
-- WRK_FILE: the file to upload; WRK_FIELD: the form field (default "image"); WRK_TYPE: its Content-Type.
local f = assert(io.open(os.getenv("WRK_FILE"), "rb"))
local data = f:read("*all")
f:close()
local field = os.getenv("WRK_FIELD") or "image"
local boundary = "capservebench7d3f9a"
wrk.method = "POST"
wrk.headers["Content-Type"] = "multipart/form-data; boundary=" .. boundary
wrk.body = "--" .. boundary .. "\r\nContent-Disposition: form-data; name=\"" .. field ..
    "\"; filename=\"image.png\"\r\nContent-Type: " .. (os.getenv("WRK_TYPE") or "image/png") ..
    "\r\n\r\n" .. data .. "\r\n--" .. boundary .. "--\r\n"

-- non-2xx answers by status code: each thread counts its own, done() adds them up
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) codes = {} end
function response(status, headers, body)
  if status >= 300 then codes[status] = (codes[status] or 0) + 1 end
end

function done(summary, latency, requests)
  local e = summary.errors
  local total = {}
  for _, thread in ipairs(threads) do
    for code, n in pairs(thread:get("codes") or {}) do total[code] = (total[code] or 0) + n end
  end
  local parts = {}
  for code, n in pairs(total) do table.insert(parts, string.format("\"%d\": %d", code, n)) end
  io.write(string.format(
    "WRK_JSON {\"requests\": %d, \"seconds\": %.6f, \"p50_ms\": %.3f, \"p99_ms\": %.3f, \"connect\": %d, " ..
    "\"read\": %d, \"write\": %d, \"status\": %d, \"timeout\": %d, \"codes\": {%s}}\n",
    summary.requests, summary.duration / 1e6, latency:percentile(50) / 1e3, latency:percentile(99) / 1e3,
    e.connect, e.read, e.write, e.status, e.timeout, table.concat(parts, ", ")))
end
