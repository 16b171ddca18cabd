-- localspec for Neovim (0.7+): fill-in-the-middle ghost text, rewrites and questions over one
-- `localspec serve --stdio` per editor (docs/protocol.md). Set up with
--   require("localspec").setup({ model = "default" })
-- Commands: :LocalspecRewrite {instruction} (on a range), :LocalspecAsk {question},
-- :LocalspecCancel, :LocalspecStats, :LocalspecToggle. Insert mode: <Tab> accepts the ghost
-- text, <S-Tab> its first line. Entering a buffer, or leaving the cursor still in normal mode,
-- reads the buffer ahead (`prefill`), so that the first completion there is warm.
-- Line numbers are Neovim's own (what "\n" separates), as the server counts them.

local M = {}
local api, fn = vim.api, vim.fn

M.config = {
  cmd = "localspec",        -- the executable
  model = nil,              -- -m MODEL (nil: the server's default)
  args = {},                -- more `serve` arguments, e.g. { "--threads", "2" }
  auto = true,              -- complete as you type
  prefill = true,           -- read a buffer ahead when it is entered or the cursor rests
  debounce_ms = 150,
  max_tokens = 64,
  max_lines = 8,            -- lines of ghost text at most
  time_budget_ms = 2000,    -- past this, the completion ends at the next line end
  prefix_lines = 256,
  suffix_lines = 64,
  rewrite_max_tokens = nil, -- nil: room for the lines twice over, as the context allows
  ring_size = 8,            -- context chunks from other buffers and yanks
  ring_chunk_lines = 64,
  keymap_accept = "<Tab>",
  keymap_accept_line = "<S-Tab>",
}

local ns = api.nvim_create_namespace("localspec")
local S = {
  job = nil, buf = "", next_id = 0, pending = {}, stderr = {},
  ghost = nil,        -- { buf, row, col, lines }
  fim_id = nil, timer = nil, rewrite = nil, ring = {}, last_stats = nil, noted = {},
  prefilled = nil,    -- what the last prefill was for: "buf:changedtick:row"
  last_prefill = nil, -- its result
}

local function notify(msg, level)
  vim.schedule(function() vim.notify("localspec: " .. msg, level or vim.log.levels.INFO) end)
end

-- -- the server ----------------------------------------------------------------------------
local function on_message(msg)
  if msg.method == "generate/progress" then
    local p = S.pending[msg.params.id]
    if p and p.on_progress then p.on_progress(msg.params.text) end
    return
  end
  local p = msg.id ~= nil and S.pending[msg.id] or nil
  if not p then
    if msg.error then notify(msg.error.message, vim.log.levels.ERROR) end
    return
  end
  S.pending[msg.id] = nil
  if msg.error then
    if p.on_error then p.on_error(msg.error.message) else
      notify(msg.error.message, vim.log.levels.ERROR) end
  elseif p.on_done then
    p.on_done(msg.result)
  end
end

local function on_stdout(_, data)
  -- data: the chunk split at newlines; its last item is an unfinished line ("" when none)
  for i, part in ipairs(data) do
    if i == 1 then S.buf = S.buf .. part else
      local line = S.buf
      S.buf = part
      if line ~= "" then
        local ok, msg = pcall(fn.json_decode, line)
        if ok and type(msg) == "table" then on_message(msg) end
      end
    end
  end
end

local function on_stderr(_, data)
  for _, line in ipairs(data) do
    if line ~= "" then
      table.insert(S.stderr, line)
      if #S.stderr > 20 then table.remove(S.stderr, 1) end
    end
  end
end

local function on_exit(_, code)
  local stopped = S.stopping
  S.job, S.buf, S.stopping = nil, "", false
  for id, p in pairs(S.pending) do
    S.pending[id] = nil
    if p.on_error then p.on_error("the server stopped") end
  end
  if code ~= 0 and not stopped then
    local last = S.stderr[#S.stderr] or ("exit status " .. code)
    notify("the server stopped: " .. last .. " (it restarts on the next command)",
           vim.log.levels.ERROR)
  end
end

-- The running server's job id, started when there is none (a dead one restarts here).
function M.server()
  if S.job then return S.job end
  local cfg = M.config
  if fn.executable(cfg.cmd) ~= 1 then
    notify("cannot start the server: the executable '" .. cfg.cmd .. "' was not found; install " ..
           "localspec or set cmd in require('localspec').setup{}", vim.log.levels.ERROR)
    return nil
  end
  local argv = { cfg.cmd, "serve", "--stdio" }
  if cfg.model then vim.list_extend(argv, { "-m", cfg.model }) end
  vim.list_extend(argv, cfg.args)
  S.stderr = {}
  local job = fn.jobstart(argv, { on_stdout = on_stdout, on_stderr = on_stderr,
                                  on_exit = on_exit })
  if job <= 0 then
    notify("cannot start '" .. cfg.cmd .. "' (jobstart returned " .. job .. ")",
           vim.log.levels.ERROR)
    return nil
  end
  S.job = job
  return job
end

-- Send a request; handlers: on_progress(text), on_done(result), on_error(message).
function M.request(method, params, handlers)
  local job = M.server()
  if not job then return nil end
  S.next_id = S.next_id + 1
  local id = S.next_id
  S.pending[id] = handlers or {}
  fn.chansend(job, fn.json_encode({ jsonrpc = "2.0", id = id, method = method,
                                    params = params }) .. "\n")
  return id
end

function M.cancel_request(id)
  if id and S.job and S.pending[id] then
    fn.chansend(S.job, fn.json_encode({ jsonrpc = "2.0", method = "cancel",
                                        params = { id = id } }) .. "\n")
  end
end

function M.stop()
  if S.job then
    S.stopping = true
    fn.jobstop(S.job)
  end
end

-- -- ghost text ------------------------------------------------------------------------------
function M.clear()
  if S.ghost then pcall(api.nvim_buf_clear_namespace, S.ghost.buf, ns, 0, -1) end
  S.ghost = nil
end

local function show(buf, row, col, text)
  M.clear()
  if text == "" then return end
  local lines = vim.split(text, "\n", true)
  local opts = { virt_text = { { lines[1], "Comment" } }, hl_mode = "combine",
                 virt_text_pos = "overlay" }
  if col < #(api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or "") then
    opts.virt_text_pos = "eol"         -- no inline virtual text before Neovim 0.10
  end
  if #lines > 1 then
    opts.virt_lines = {}
    for i = 2, #lines do table.insert(opts.virt_lines, { { lines[i], "Comment" } }) end
  end
  api.nvim_buf_set_extmark(buf, ns, row, col, opts)
  S.ghost = { buf = buf, row = row, col = col, lines = lines }
end

function M.ghost_text()
  return S.ghost and table.concat(S.ghost.lines, "\n") or nil
end

local function ring_chunks()
  local out = {}
  for _, c in ipairs(S.ring) do table.insert(out, { filename = c.filename, text = c.text }) end
  return #out > 0 and out or nil       -- an empty Lua table would encode as {}
end

-- The `complete` params for the cursor in the current window: buf, row, col, params.
local function cursor_params()
  local buf = api.nvim_get_current_buf()
  local pos = api.nvim_win_get_cursor(0)
  local row, col = pos[1] - 1, pos[2]
  local lines = api.nvim_buf_get_lines(buf, 0, -1, false)
  local cur = lines[row + 1] or ""
  local before = {}
  for i = math.max(1, row + 1 - M.config.prefix_lines), row do table.insert(before, lines[i]) end
  table.insert(before, cur:sub(1, col))
  local after = { cur:sub(col + 1) }
  for i = row + 2, math.min(#lines, row + 1 + M.config.suffix_lines) do
    table.insert(after, lines[i])
  end
  local indent = #(cur:match("^%s*") or "")
  return buf, row, col, {
    prefix = table.concat(before, "\n"), suffix = table.concat(after, "\n"),
    extra = ring_chunks(), filename = fn.fnamemodify(api.nvim_buf_get_name(buf), ":t"),
    max_tokens = M.config.max_tokens, max_lines = M.config.max_lines,
    time_budget_ms = M.config.time_budget_ms, min_indent = indent > 0 and indent or nil,
  }
end

-- Read the buffer ahead at the cursor (`prefill`), once per buffer state and cursor line, so
-- that the first completion typed there finds the buffer in the server's cache.
function M.prefill()
  if vim.bo.buftype ~= "" then return end
  local buf, row, _, params = cursor_params()
  local key = buf .. ":" .. api.nvim_buf_get_changedtick(buf) .. ":" .. row
  if key == S.prefilled then return end
  S.prefilled = key
  M.request("prefill", params, {
    on_done = function(r) S.last_prefill = r end,
    on_error = function() end,          -- a model without FIM tokens: completion will say so
  })
end

-- Ask for a completion at the cursor (insert mode); an earlier one is cancelled by the server.
function M.complete()
  local buf, row, col, params = cursor_params()
  local tick = api.nvim_buf_get_changedtick(buf)
  params.stream = false
  S.fim_id = M.request("complete", params, {
    on_done = function(r)
      S.last_stats = r.stats
      if r.truncated and not S.noted[buf] then   -- once per buffer: it holds while typing
        S.noted[buf] = true
        notify(r.note)
      end
      local p = api.nvim_win_get_cursor(0)
      if api.nvim_get_current_buf() == buf and api.nvim_buf_get_changedtick(buf) == tick
          and p[1] - 1 == row and p[2] == col and fn.mode():sub(1, 1) == "i" then
        show(buf, row, col, r.text)
      end
    end,
    on_error = function(message) notify(message, vim.log.levels.WARN) end,
  })
end

local function schedule_complete()
  M.clear()
  if S.timer then S.timer:stop() end
  S.timer = S.timer or vim.loop.new_timer()
  S.timer:start(M.config.debounce_ms, 0, vim.schedule_wrap(function()
    if fn.mode():sub(1, 1) == "i" then M.complete() end
  end))
end

-- Insert the ghost text (all of it, or its first line); false when there is none.
function M.accept(first_line_only)
  local g = S.ghost
  if not g then return false end
  local lines = first_line_only and { g.lines[1] } or g.lines
  M.clear()
  api.nvim_buf_set_text(g.buf, g.row, g.col, g.row, g.col, lines)
  local last = #lines == 1 and g.col + #lines[1] or #lines[#lines]
  api.nvim_win_set_cursor(0, { g.row + #lines, last })
  return true
end

local function accept_key(first_line_only, key)
  return function()
    if S.ghost then
      vim.schedule(function() M.accept(first_line_only) end)
      return ""
    end
    return api.nvim_replace_termcodes(key, true, false, true)
  end
end

-- -- the ring: chunks of other buffers and yanks -----------------------------------------------
local function ring_add(filename, text)
  if text:match("^%s*$") then return end
  for i, c in ipairs(S.ring) do
    if c.text == text then table.remove(S.ring, i) break end
  end
  table.insert(S.ring, { filename = filename, text = text })
  while #S.ring > M.config.ring_size do table.remove(S.ring, 1) end
end

local function ring_buffer_chunk()
  local buf = api.nvim_get_current_buf()
  if vim.bo[buf].buftype ~= "" then return end
  local row = api.nvim_win_get_cursor(0)[1]
  local half = math.floor(M.config.ring_chunk_lines / 2)
  local lines = api.nvim_buf_get_lines(buf, math.max(0, row - half), row + half, false)
  ring_add(fn.fnamemodify(api.nvim_buf_get_name(buf), ":t"), table.concat(lines, "\n") .. "\n")
end

-- -- rewrite and ask -----------------------------------------------------------------------------
-- Rewrite lines l1..l2 of the current buffer as `instruction` says, streamed into the buffer
-- as one undo step; :LocalspecCancel (or an error) puts the original lines back.
function M.rewrite(instruction, l1, l2)
  if S.rewrite then notify("a rewrite is already running (:LocalspecCancel stops it)") return end
  local buf = api.nvim_get_current_buf()
  local all = api.nvim_buf_get_lines(buf, 0, -1, false)
  local original = api.nvim_buf_get_lines(buf, l1 - 1, l2, false)
  local state = { buf = buf, l1 = l1, n = #original, original = original, text = "",
                  started = false }
  local function put(lines)
    if state.started then pcall(vim.cmd, "undojoin") end
    state.started = true
    api.nvim_buf_set_lines(buf, state.l1 - 1, state.l1 - 1 + state.n, false, lines)
    state.n = #lines
  end
  local function restore()
    if api.nvim_buf_is_valid(buf) and state.started then put(original) end
  end
  state.id = M.request("rewrite", {
    text = table.concat(all, "\n") .. "\n", instruction = instruction, region = { l1, l2 },
    filename = fn.fnamemodify(api.nvim_buf_get_name(buf), ":t"),
    max_tokens = M.config.rewrite_max_tokens,
  }, {
    on_progress = function(piece)
      state.text = state.text .. piece
      put(vim.split(state.text, "\n", true))
    end,
    on_done = function(r)
      S.rewrite, S.last_result = nil, r.text
      local text = r.text:gsub("\n$", "")
      put(vim.split(text, "\n", true))
      local st = r.stats
      notify(string.format("rewrote %d lines: %d tokens, %.1f tok/s, %d/%d drafts accepted",
                           #original, st.generated_tokens, st.decode_tokens_per_s,
                           st.accepted, st.drafted))
    end,
    on_error = function(message)
      S.rewrite = nil
      restore()
      if state.cancelled then
        notify("rewrite cancelled; the lines are as they were")
      else
        notify(message, vim.log.levels.ERROR)
      end
    end,
  })
  if state.id then S.rewrite = state end
end

function M.cancel()
  if S.rewrite then
    S.rewrite.cancelled = true
    M.cancel_request(S.rewrite.id)
  end
  if S.fim_id then M.cancel_request(S.fim_id) end
  M.clear()
end

-- Ask about the current buffer; the answer streams into a scratch split.
function M.ask(question)
  local src = api.nvim_get_current_buf()
  local text = table.concat(api.nvim_buf_get_lines(src, 0, -1, false), "\n")
  vim.cmd("botright new")
  local out = api.nvim_get_current_buf()
  vim.bo[out].buftype, vim.bo[out].bufhidden, vim.bo[out].swapfile = "nofile", "wipe", false
  api.nvim_buf_set_name(out, "localspec://answer/" .. out)
  local acc = ""
  M.request("generate", {
    messages = { { role = "user", content = "File " ..
      fn.fnamemodify(api.nvim_buf_get_name(src), ":t") .. ":\n" .. text .. "\n\n" .. question } },
    document = text, max_tokens = 512,
  }, {
    on_progress = function(piece)
      acc = acc .. piece
      if api.nvim_buf_is_valid(out) then
        api.nvim_buf_set_lines(out, 0, -1, false, vim.split(acc, "\n", true))
      end
    end,
    on_done = function(r) S.last_stats = r.stats end,
  })
end

function M.stats()
  local st = S.last_stats
  if not st then notify("no request has finished yet") return end
  notify(string.format("%d tokens, %.1f tok/s, prompt %d (%d reused), %d/%d drafts accepted",
                       st.generated_tokens, st.decode_tokens_per_s, st.prompt_tokens,
                       st.reused_tokens, st.accepted, st.drafted))
end

-- -- set-up ---------------------------------------------------------------------------------------
function M.setup(opts)
  M.config = vim.tbl_extend("force", M.config, opts or {})
  local group = api.nvim_create_augroup("localspec", { clear = true })
  api.nvim_create_autocmd("TextChangedI", { group = group, callback = function()
    if M.config.auto then schedule_complete() end
  end })
  api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, { group = group, callback = function()
    if S.fim_id then M.cancel_request(S.fim_id) end
    M.clear()
  end })
  api.nvim_create_autocmd("BufLeave", { group = group, callback = ring_buffer_chunk })
  api.nvim_create_autocmd({ "BufEnter", "CursorHold" }, { group = group, callback = function()
    if M.config.auto and M.config.prefill then M.prefill() end
  end })
  api.nvim_create_autocmd("TextYankPost", { group = group, callback = function()
    ring_add("yank", table.concat(vim.v.event.regcontents or {}, "\n") .. "\n")
  end })
  api.nvim_create_autocmd("VimLeavePre", { group = group, callback = M.stop })
  vim.keymap.set("i", M.config.keymap_accept, accept_key(false, M.config.keymap_accept),
                 { expr = true, desc = "localspec: accept the completion" })
  vim.keymap.set("i", M.config.keymap_accept_line,
                 accept_key(true, M.config.keymap_accept_line),
                 { expr = true, desc = "localspec: accept one line" })
  api.nvim_create_user_command("LocalspecRewrite", function(c)
    M.rewrite(c.args, c.line1, c.line2)
  end, { nargs = "+", range = "%" })
  api.nvim_create_user_command("LocalspecAsk", function(c) M.ask(c.args) end, { nargs = "+" })
  api.nvim_create_user_command("LocalspecCancel", M.cancel, {})
  api.nvim_create_user_command("LocalspecStats", M.stats, {})
  api.nvim_create_user_command("LocalspecToggle", function()
    M.config.auto = not M.config.auto
    notify("completion as you type " .. (M.config.auto and "on" or "off"))
  end, {})
end

M._state = S   -- for tests
return M
