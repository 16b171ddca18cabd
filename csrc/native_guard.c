/* native_guard.c: llama.cpp's log sink, ggml's abort hook and the fatal-signal guard, in C so
 * that no Python runs on llama.cpp's threads or at exit (native_guard.h says what each does). */
#define _GNU_SOURCE
#include "native_guard.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__GLIBC__) || defined(__APPLE__)
#include <execinfo.h>
#define LSN_HAVE_BACKTRACE 1
#endif

/* ------------------------------------------------------------------------------------------ */
/* Log sink: a byte ring of records [int32 level][uint32 length][text], oldest first.          */

#define LSN_RING (1u << 18)          /* 256 KiB: a load's whole debug log, many times over */
#define LSN_MSG_MAX 4096u            /* a longer message is cut (llama.cpp's are < 1 KiB) */
#define LSN_KEEP_MAX 16

static pthread_mutex_t g_log_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char g_ring[LSN_RING];
static uint64_t g_head, g_tail;      /* read and write offsets, never wrapped: used = tail - head */
static uint64_t g_dropped;
static int g_min_level = 4;          /* errors only until Python says otherwise */
static int g_last_kept;              /* the filter's decision for the message a CONT continues */
static char g_keep_buf[1024];
static const char *g_keep[LSN_KEEP_MAX];
static int g_n_keep;

static void ring_put(const void *src, uint32_t n) {
    const unsigned char *s = src;
    for (uint32_t i = 0; i < n; i++)
        g_ring[(g_tail + i) % LSN_RING] = s[i];
    g_tail += n;
}

static void ring_read(uint64_t at, void *dst, uint32_t n) {
    unsigned char *d = dst;
    for (uint32_t i = 0; i < n; i++)
        d[i] = g_ring[(at + i) % LSN_RING];
}

static int keep_message(int level, const char *text) {
    if (level >= g_min_level)
        return 1;
    for (int i = 0; i < g_n_keep; i++)
        if (strstr(text, g_keep[i]))
            return 1;
    return 0;
}

void lsn_log_sink(int level, const char *text, void *user_data) {
    (void)user_data;
    if (!text)
        return;
    pthread_mutex_lock(&g_log_lock);
    int kept = level == 5 ? g_last_kept : keep_message(level, text);
    if (level != 5)
        g_last_kept = kept;
    if (kept) {
        size_t len = strlen(text);
        uint32_t n = len > LSN_MSG_MAX ? LSN_MSG_MAX : (uint32_t)len;
        while (LSN_RING - (g_tail - g_head) < 8u + n) {   /* full: the oldest go first */
            uint32_t old;
            ring_read(g_head + 4, &old, 4);
            g_head += 8u + old;
            g_dropped++;
        }
        int32_t lv = level;
        ring_put(&lv, 4);
        ring_put(&n, 4);
        ring_put(text, n);
    }
    pthread_mutex_unlock(&g_log_lock);
}

int lsn_log_configure(int min_level, const char *keep) {
    size_t len = keep ? strlen(keep) : 0;
    if (len >= sizeof g_keep_buf)
        return -1;
    pthread_mutex_lock(&g_log_lock);
    g_min_level = min_level;
    memcpy(g_keep_buf, keep ? keep : "", len + 1);
    g_n_keep = 0;
    char *p = g_keep_buf;
    while (*p && g_n_keep < LSN_KEEP_MAX) {
        char *end = strchr(p, '\n');
        if (end)
            *end = '\0';
        if (*p)
            g_keep[g_n_keep++] = p;
        if (!end)
            break;
        p = end + 1;
    }
    pthread_mutex_unlock(&g_log_lock);
    return 0;
}

int lsn_log_pop(int *level, char *out, size_t cap) {
    int n = -1;
    pthread_mutex_lock(&g_log_lock);
    if (g_tail != g_head) {
        int32_t lv;
        uint32_t len;
        ring_read(g_head, &lv, 4);
        ring_read(g_head + 4, &len, 4);
        uint32_t copy = cap ? (len < cap - 1 ? len : (uint32_t)(cap - 1)) : 0;
        ring_read(g_head + 8, out, copy);
        if (cap)
            out[copy] = '\0';
        g_head += 8u + len;
        *level = lv;
        n = (int)len;
    }
    pthread_mutex_unlock(&g_log_lock);
    return n;
}

uint64_t lsn_log_dropped(void) {
    pthread_mutex_lock(&g_log_lock);
    uint64_t n = g_dropped;
    g_dropped = 0;
    pthread_mutex_unlock(&g_log_lock);
    return n;
}

/* ------------------------------------------------------------------------------------------ */
/* Guard. Everything the handlers touch is static and prepared beforehand; they call only
 * async-signal-safe functions (write, open, read, lseek, close, _exit, sigaction, nanosleep;
 * backtrace is made safe by a first call at install, which loads libgcc).                   */

static const int g_signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
#define LSN_NSIG ((int)(sizeof g_signals / sizeof g_signals[0]))
static struct sigaction g_prev[LSN_NSIG];
static char g_report_path[1024];
static int g_python_fd = -1;
static int g_exit_code = 86;
static volatile sig_atomic_t g_installed;
static volatile sig_atomic_t g_crashing;
static pthread_mutex_t g_phase_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_phase[2][768];          /* double-buffered: a handler reads the one published */
static volatile sig_atomic_t g_phase_cur;
static char g_line[2048];             /* the line being written, composed in place */
static char g_altstack[1 << 16];

static char g_lost_line[512], g_lost_hint[256], g_interrupted_line[512];
static volatile sig_atomic_t g_lost_on, g_interrupted, g_pending, g_released;
static int g_lost_wait_ms;
static char g_pending_reason[512];

/* Append s to buf (one line: its line breaks become spaces); cap leaves room for the '\n'. */
static size_t append(char *buf, size_t at, size_t cap, const char *s) {
    while (s && *s && at + 2 < cap) {
        buf[at++] = (*s == '\n' || *s == '\r') ? ' ' : *s;
        s++;
    }
    buf[at] = '\0';
    return at;
}

static size_t end_line(char *buf, size_t at) {
    buf[at++] = '\n';
    buf[at] = '\0';
    return at;
}

static void write_all(int fd, const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void put(int fd, const char *s) {
    write_all(fd, s, strlen(s));
}

static const char *signal_name(int sig) {
    switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    case SIGFPE: return "SIGFPE";
    case SIGABRT: return "SIGABRT";
    default: return "a fatal signal";
    }
}

#define LSN_TAIL (16u << 10)         /* the last 16 KiB of messages go into a report */

static void dump_log_tail(int fd) {
    /* Unlocked on purpose (the crashing thread may hold the lock): best effort, bounds-checked. */
    uint64_t at = g_head, end = g_tail;
    if (end - at > LSN_RING)
        return;
    static char text[LSN_MSG_MAX + 1];
    while (at + 8 <= end) {
        uint32_t skip;
        ring_read(at + 4, &skip, 4);
        if (end - at <= LSN_TAIL || skip > LSN_MSG_MAX)
            break;
        at += 8u + skip;
    }
    while (at + 8 <= end) {
        uint32_t len;
        ring_read(at + 4, &len, 4);
        if (len > LSN_MSG_MAX || at + 8 + len > end)
            return;
        ring_read(at + 8, text, len);
        write_all(fd, text, len);
        at += 8u + len;
    }
}

/* Python's stack, copied from python_fd into the report. faulthandler writes it there: first,
 * when it was enabled after this guard (its handler runs, then raises the signal again into
 * ours), or now, when it was enabled before (ours chains to it; the signal it raises at the end
 * stays blocked, and we exit first). */
static void python_stack(int fd, int sig) {
    int slot = -1;
    for (int i = 0; i < LSN_NSIG; i++)
        if (g_signals[i] == sig)
            slot = i;
    if (g_python_fd < 0 || slot < 0)
        return;
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, sig);
    pthread_sigmask(SIG_BLOCK, &block, NULL);
    struct sigaction *prev = &g_prev[slot];
    if (prev->sa_flags & SA_SIGINFO) {
        if (prev->sa_sigaction)
            prev->sa_sigaction(sig, NULL, NULL);
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
    }
    put(fd, "\nPython stack (faulthandler):\n");
    if (lseek(g_python_fd, 0, SEEK_SET) < 0)
        return;
    char buf[4096];
    ssize_t n;
    while ((n = read(g_python_fd, buf, sizeof buf)) > 0)
        write_all(fd, buf, (size_t)n);
}

/* The one line on stderr, then the report; never returns. */
static void crash(int sig, const char *what, const char *detail) {
    if (__sync_lock_test_and_set(&g_crashing, 1)) {
        for (;;)                          /* another thread is reporting: it exits for us */
            pause();
    }
    const char *phase = g_phase[g_phase_cur];
    size_t n = append(g_line, 0, sizeof g_line, "error: ");
    n = append(g_line, n, sizeof g_line, what);
    n = append(g_line, n, sizeof g_line, " (");
    n = append(g_line, n, sizeof g_line, detail);
    n = append(g_line, n, sizeof g_line, ") ");
    n = append(g_line, n, sizeof g_line, *phase ? phase : "while localspec was running");
    int fd = g_report_path[0] ? open(g_report_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                                     0600) : -1;
    if (fd >= 0) {
        n = append(g_line, n, sizeof g_line, "; report: ");
        n = append(g_line, n, sizeof g_line, g_report_path);
    }
    n = end_line(g_line, n);
    write_all(2, g_line, n);
    if (fd < 0)
        _exit(g_exit_code);
    put(fd, "localspec: a crash inside llama.cpp\n\n");
    write_all(fd, g_line, n);
    put(fd, "\nnative stack (the crashing thread):\n");
#ifdef LSN_HAVE_BACKTRACE
    void *frames[128];
    int depth = backtrace(frames, 128);
    backtrace_symbols_fd(frames, depth, fd);
#else
    put(fd, "(not available on this platform)\n");
#endif
    put(fd, "\nllama.cpp's last log messages kept:\n");
    dump_log_tail(fd);
    python_stack(fd, sig);
    close(fd);
    _exit(g_exit_code);
}

static char g_abort_reason[512];
static volatile sig_atomic_t g_aborting;

static void on_fatal_signal(int sig, siginfo_t *info, void *uctx) {
    (void)info;
    (void)uctx;
    if (sig == SIGABRT && g_aborting)
        crash(sig, "aborted", g_abort_reason);
    crash(sig, "crashed", signal_name(sig));
}

int lsn_guard_install(const char *report_path, int python_fd, int exit_code) {
    size_t len = report_path ? strlen(report_path) : 0;
    if (len >= sizeof g_report_path)
        len = 0;
    memcpy(g_report_path, report_path ? report_path : "", len);
    g_report_path[len] = '\0';
    g_python_fd = python_fd;
    g_exit_code = exit_code;
    if (g_installed)
        return 0;
#ifdef LSN_HAVE_BACKTRACE
    void *warm[2];
    backtrace(warm, 2);                    /* loads libgcc now, not in the handler */
#endif
    stack_t old;
    if (sigaltstack(NULL, &old) == 0 && (old.ss_flags & SS_DISABLE)) {
        stack_t ss = {0};                  /* a stack overflow still gets its line */
        ss.ss_sp = g_altstack;
        ss.ss_size = sizeof g_altstack;
        sigaltstack(&ss, NULL);
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fatal_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < LSN_NSIG; i++)
        if (sigaction(g_signals[i], &sa, &g_prev[i]) != 0)
            return -1;
    g_installed = 1;
    return 0;
}

void lsn_guard_uninstall(void) {
    if (!g_installed)
        return;
    for (int i = 0; i < LSN_NSIG; i++)
        sigaction(g_signals[i], &g_prev[i], NULL);
    g_installed = 0;
}

void lsn_guard_set_phase(const char *phase) {
    pthread_mutex_lock(&g_phase_lock);
    int next = 1 - g_phase_cur;
    size_t len = phase ? strlen(phase) : 0;
    if (len >= sizeof g_phase[0])
        len = sizeof g_phase[0] - 1;
    memcpy(g_phase[next], phase ? phase : "", len);
    g_phase[next][len] = '\0';
    __sync_synchronize();
    g_phase_cur = next;
    pthread_mutex_unlock(&g_phase_lock);
}

/* ------------------------------------------------------------------------------------------ */
/* ggml's abort hook                                                                          */

static void copy_str(char *dst, size_t cap, const char *src) {
    size_t len = src ? strlen(src) : 0;
    if (len >= cap)
        len = cap - 1;
    memcpy(dst, src ? src : "", len);
    dst[len] = '\0';
}

void lsn_abort_set_lost(const char *lost_line, const char *lost_hint,
                        const char *interrupted_line, int wait_ms) {
    copy_str(g_lost_line, sizeof g_lost_line, lost_line);
    copy_str(g_lost_hint, sizeof g_lost_hint, lost_hint);
    copy_str(g_interrupted_line, sizeof g_interrupted_line, interrupted_line);
    g_lost_wait_ms = wait_ms;
    g_lost_on = lost_line != NULL;
}

void lsn_abort_interrupted(int yes) { g_interrupted = yes != 0; }

int lsn_abort_pending(char *reason, size_t cap) {
    if (!g_pending)
        return 0;
    if (cap)
        copy_str(reason, cap, g_pending_reason);
    return 1;
}

void lsn_abort_release(void) { g_released = 1; }

void lsn_abort_hook(const char *message) {
    /* ggml's message is "file:line: reason"; the reason is what a user can act on */
    const char *why = message ? strstr(message, ": ") : NULL;
    why = why ? why + 2 : (message ? message : "");
    if (!g_lost_on) {
        /* as abort() would, through whichever handler is first (faulthandler writes Python's
           stack, then hands the signal to ours), with ggml's reason kept for the line */
        size_t len = strlen(why);
        if (len >= sizeof g_abort_reason)
            len = sizeof g_abort_reason - 1;
        memcpy(g_abort_reason, why, len);
        g_abort_reason[len] = '\0';
        g_aborting = 1;
        raise(SIGABRT);
        crash(SIGABRT, "aborted", g_abort_reason);   /* no handler took it (guard off) */
    }
    size_t n = append(g_line, 0, sizeof g_line, "error: ");
    n = append(g_line, n, sizeof g_line, g_interrupted ? g_interrupted_line : g_lost_line);
    n = append(g_line, n, sizeof g_line, " (");
    n = append(g_line, n, sizeof g_line, why);
    n = append(g_line, n, sizeof g_line, ")");
    n = append(g_line, n, sizeof g_line, g_interrupted ? "." : g_lost_hint);
    n = end_line(g_line, n);
    write_all(2, g_line, n);
    if (g_interrupted)
        _exit(130);
    copy_str(g_pending_reason, sizeof g_pending_reason, why);
    g_pending = 1;                       /* a Python thread tells the clients, then releases */
    struct timespec tick = {0, 10 * 1000 * 1000};
    for (int waited = 0; !g_released && waited < g_lost_wait_ms; waited += 10)
        nanosleep(&tick, NULL);
    _exit(1);
}

/* ------------------------------------------------------------------------------------------ */

static int *volatile g_null;

void lsn_test_crash(int how) {
    if (how == 1)
        abort();
    if (how == 2)
        lsn_abort_hook("native_guard.c:1: a test abort");
    *g_null = 1;
}
