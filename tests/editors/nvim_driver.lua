-- Driven by tests/editors/test_nvim.py: one scenario in headless Neovim against a real
-- `localspec serve --stdio`. Keys go through the typeahead as a user's would (feedkeys, handled
-- by the main loop after this file returns), so steps run from a polling timer: each waits for
-- its condition, then acts. What was seen is written as JSON to $LOCALSPEC_TEST_OUT.
local api = vim.api
local out, messages = {}, {}
local real_notify = vim.notify
vim.notify = function(msg, level)
  table.insert(messages, { msg = msg, level = level or 0 })
  return real_notify(msg, level)
end
local function lines() return api.nvim_buf_get_lines(0, 0, -1, false) end
local function keys(k) api.nvim_feedkeys(api.nvim_replace_termcodes(k, true, false, true), "t", false) end

local function finish(err)
  out.error = err
  out.messages = messages
  local f = io.open(vim.env.LOCALSPEC_TEST_OUT, "w")
  f:write(vim.fn.json_encode(out))
  f:close()
  pcall(function() require("localspec").stop() end)
  vim.cmd("qall!")
end

-- steps: { {name, cond(), act()} ... }: run act once cond holds; 100 s per step at most
local function run(steps)
  local i, since = 1, vim.loop.now()
  local timer = vim.loop.new_timer()
  timer:start(50, 50, vim.schedule_wrap(function()
    local step = steps[i]
    if not step then timer:stop() return end
    local ok, ready = pcall(step[2])
    if not ok then timer:stop() return finish(step[1] .. ": " .. tostring(ready)) end
    if not ready then
      if vim.loop.now() - since > 100000 then timer:stop() return finish("timeout in " .. step[1]) end
      return
    end
    local ok2, err = pcall(step[3])
    if not ok2 then timer:stop() return finish(step[1] .. ": " .. tostring(err)) end
    i, since = i + 1, vim.loop.now()
    if not steps[i] then timer:stop() finish(nil) end
  end))
end

local function always() return true end
local function said(text)      -- notify() runs scheduled: wait for the message itself
  return function()
    for _, m in ipairs(messages) do if m.msg:find(text, 1, true) then return true end end
    return false
  end
end
local ls, S

local scenarios = {}

function scenarios.ghost()
  api.nvim_buf_set_lines(0, 0, -1, false, { "def f(x):", "    return x + 1", "", "def g" })
  api.nvim_win_set_cursor(0, { 4, 4 })
  keys("A(x")                                       -- typing in insert mode: TextChangedI
  run({
    { "ghost text appears", function() return ls.ghost_text() ~= nil end, function()
      out.ghost = ls.ghost_text()
      out.mode = vim.fn.mode()
      out.extmarks = #api.nvim_buf_get_extmarks(0, api.nvim_create_namespace("localspec"),
                                                0, -1, {})
      out.typed = lines()[4]
      keys("<Tab>")
    end },
    { "Tab accepts it", function() return lines()[4] ~= out.typed end, function()
      out.after_tab = lines()
      keys("<Esc>")
    end },
  })
end

function scenarios.rewrite()
  api.nvim_buf_set_lines(0, 0, -1, false, { "a = 1", "b = 2", "c = 3" })
  vim.cmd("2LocalspecRewrite make it longer")
  out.started = S.rewrite ~= nil
  run({
    { "the rewrite ends", said("rewrote"), function()
      out.lines = lines()
      out.result = S.last_result
      vim.cmd("silent! undo")
      out.after_undo = lines()
    end },
  })
end

function scenarios.cancel()
  api.nvim_buf_set_lines(0, 0, -1, false, { "a = 1", "prompt 54: eeeee", "c = 3" })
  vim.cmd("2LocalspecRewrite go on")
  run({
    { "text streams in", function() return S.rewrite and #S.rewrite.text > 20 end, function()
      out.during = lines()
      vim.cmd("LocalspecCancel")
    end },
    { "the rewrite ends", said("rewrite cancelled"), function()
      out.lines = lines()
    end },
  })
end

function scenarios.formfeed()
  -- a form feed is a character of line 2, not a line break: line 3 is "beta = 2" (issue 43)
  api.nvim_buf_set_lines(0, 0, -1, false, { "alpha = 1", "\12", "beta = 2", "gamma = 3" })
  vim.cmd("3LocalspecRewrite make it longer")
  run({
    { "the rewrite ends", function() return S.rewrite == nil and #messages > 0 end, function()
      out.lines = lines()
      out.result = S.last_result
    end },
  })
end

function scenarios.prefill()
  local body = {}
  for i = 1, 20 do
    table.insert(body, "def f" .. i .. "(x):")
    table.insert(body, "    return x + " .. i)
  end
  table.insert(body, "def g")
  api.nvim_buf_set_lines(0, 0, -1, false, body)
  api.nvim_win_set_cursor(0, { #body, 4 })
  vim.cmd("doautocmd BufEnter")                     -- as entering the buffer does
  run({
    { "the buffer is read ahead", function() return S.last_prefill ~= nil end, function()
      out.prefill = S.last_prefill
      keys("A(x")
    end },
    { "ghost text appears", function() return ls.ghost_text() ~= nil end, function()
      out.stats = S.last_stats
      keys("<Esc>")
    end },
  })
end

function scenarios.missing()
  api.nvim_buf_set_lines(0, 0, -1, false, { "x = 1" })
  out.complete_ok = pcall(ls.complete)
  out.rewrite_ok = pcall(vim.cmd, "LocalspecRewrite anything")
  out.lines = lines()
  run({ { "messages shown", said("was not found"), always } })
end

local ok, err = pcall(function()
  local root = vim.env.LOCALSPEC_PLUGIN
  package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
  ls = require("localspec")
  S = ls._state
  ls.setup({
    cmd = vim.env.LOCALSPEC_CMD, model = vim.env.LOCALSPEC_TEST_MODEL,
    args = { "--threads", "1", "--ctx", vim.env.LOCALSPEC_TEST_CTX or "2048" }, debounce_ms = 20,
    max_tokens = 6, max_lines = 1, time_budget_ms = 0,
    rewrite_max_tokens = tonumber(vim.env.LOCALSPEC_TEST_REWRITE_MAX),
  })
  scenarios[vim.env.LOCALSPEC_SCENARIO]()
end)
if not ok then finish(tostring(err)) end
