/* native_guard.h: what localspec hands to llama.cpp's native code instead of Python callbacks.
 *
 * llama.cpp calls its log callback and ggml's abort hook from any thread (CUDA's, the CPU
 * backend's workers) and at exit, after Python may have finalised; a fatal signal inside it
 * leaves no Python frame to report from. So all three are C, here, and Python only reads what
 * they kept after the call returns (localspec/llama/native.py is the one wrapper):
 *
 *   log sink   a bounded, thread-safe ring of messages with a level filter. Installed with
 *              llama_log_set(lsn_log_sink, NULL); Python pops messages after each call that
 *              can log. When full, the oldest messages go first (lsn_log_dropped counts them).
 *   guard      a fatal-signal handler (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, on an
 *              alternate stack) and ggml's abort hook: each writes one line prepared by Python
 *              beforehand ("error: crashed (SIGSEGV) in llama.cpp while loading M onto CUDA0
 *              (try ...); report: PATH") with async-signal-safe write(2), then a report file with
 *              the native stack (backtrace_symbols_fd), the last log lines and Python's
 *              faulthandler stack, and exits with the code it was given.
 *   lost hook  while RPC servers are attached, ggml's abort means a lost server: the hook writes
 *              the line Python prepared, flags it for a Python thread (lsn_abort_pending) that
 *              tells clients, waits for it a bounded time, and exits.
 *
 * Levels are enum ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continues the message
 * before it (and so follows its filter decision).
 */
#ifndef LSN_NATIVE_GUARD_H
#define LSN_NATIVE_GUARD_H

#include <stddef.h>
#include <stdint.h>

/* LSN_CDEF_BEGIN */
/* ggml_log_callback's signature. Keeps a message when its level >= the minimum, or when it
   contains one of the keep substrings (lsn_log_configure). Thread-safe. */
void lsn_log_sink(int level, const char *text, void *user_data);
/* Minimum level to keep, and '\n'-separated substrings kept at any level (placement lines,
   backend failures); at most 1023 bytes of them. Returns 0, or -1 when `keep` is too long. */
int lsn_log_configure(int min_level, const char *keep);
/* Pop the oldest kept message into out[cap] (NUL-terminated, cut at cap - 1 bytes): returns its
   full length and sets *level, or -1 when the ring is empty. */
int lsn_log_pop(int *level, char *out, size_t cap);
/* How many messages the full ring dropped since the last call (and resets the count). */
uint64_t lsn_log_dropped(void);

/* Install the fatal-signal handlers (once per process; later calls only update the settings).
   report_path: where a crash writes its report; python_fd: a file faulthandler was enabled on
   (its stack is copied into the report), or -1; exit_code: the process's exit status after a
   crash. Returns 0, or -1 if a handler could not be installed. */
int lsn_guard_install(const char *report_path, int python_fd, int exit_code);
/* Put back the signal handlers lsn_guard_install found (a process that must die of the bare
   signal, e.g. the RPC server's worker, whose parent reads the signal). */
void lsn_guard_uninstall(void);
/* What localspec is doing now, e.g. "in llama.cpp while loading m.gguf onto CPU (try ...)":
   the crash line says it after "error: crashed (SIGSEGV) ". Copied (at most 767 bytes); safe
   to call from any thread at any time. */
void lsn_guard_set_phase(const char *phase);
/* ggml_abort_callback_t: ggml_abort() calls it before abort(). */
void lsn_abort_hook(const char *message);
/* While RPC servers are attached: the abort hook writes "error: " + lost_line + " (" + ggml's
   reason + ")" + lost_hint, flags it, waits up to wait_ms for lsn_abort_release(), exits 1
   (130 after lsn_abort_interrupted(1), with interrupted_line). NULL lost_line: off again. */
void lsn_abort_set_lost(const char *lost_line, const char *lost_hint,
                        const char *interrupted_line, int wait_ms);
void lsn_abort_interrupted(int yes);
/* 1 once the lost hook has run (a Python thread then tells clients), and its reason. */
int lsn_abort_pending(char *reason, size_t cap);
void lsn_abort_release(void);

/* Tests only: crash the calling thread inside native code. how: 0 SIGSEGV (a NULL write),
   1 SIGABRT (abort()), 2 the abort hook (as ggml_abort would). */
void lsn_test_crash(int how);
/* LSN_CDEF_END */

#endif
