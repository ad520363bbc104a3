// The waiter: what the supervisor of a sandboxed daemon becomes once the
// daemon runs (waiter.go). A Go process idles at about a megabyte of
// anonymous memory (heap arenas, stacks, the runtime's own structures);
// this binary exec'd again stops here, in a constructor, before the Go
// runtime starts, and waits for the daemon in a few pages. It never returns
// to Go: when the daemon is gone it execs the binary once more as the Go
// "reaped" stage, which reports and cleans up.
//
// Nothing here runs unless GOVIRTIOFSD_SANDBOX_STAGE is wait or reaped:
// the daemon, its other stages and test binaries pay one getenv.

#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include "waiter.h"

// The supervisor's side of the hand-over (handOver in waiter.go).
//
// A stop signal must not be lost while the supervisor turns into the
// waiter. The exec ends every thread but the one that calls it, and a
// signal another thread has taken from the process's queue dies with that
// thread, be it still in the kernel or already in a handler (on a busy
// machine a thread can be preempted there for milliseconds). So, before
// the exec, every thread blocks the stop signals, which then stay pending
// for the process and survive the exec, and a signal a thread took before
// it blocked them is passed on to the exec'ing thread first.

static pid_t handover_tid; // the thread that will exec
static int handover_acks;  // threads that have blocked the stop signals

static void stop_signals(sigset_t *set) {
	sigaddset(set, SIGTERM);
	sigaddset(set, SIGINT);
	sigaddset(set, SIGHUP);
}

// handover_signal passes a stop signal caught by another thread on to the
// thread that will exec, where it is blocked: it stays pending there across
// the exec, and the waiter takes it. Async-signal-safe: a system call.
static void handover_signal(int sig) {
	int saved = errno;
	syscall(SYS_tgkill, getpid(), handover_tid, sig);
	errno = saved;
}

// handover_block makes the thread it runs on block the stop signals once
// it returns. HANDOVER_MARK is blocked while handover_signal runs, so it
// runs after any stop signal the thread took before.
static void handover_block(int sig, siginfo_t *info, void *ctx) {
	(void)sig;
	(void)info;
	stop_signals(&((ucontext_t *)ctx)->uc_sigmask);
	__atomic_add_fetch(&handover_acks, 1, __ATOMIC_SEQ_CST);
}

int sandbox_handover_begin(void) {
	sigset_t stop;
	sigemptyset(&stop);
	stop_signals(&stop);
	// Blocked on this thread: the mask survives the exec.
	if (pthread_sigmask(SIG_BLOCK, &stop, NULL) != 0)
		return -1;
	handover_tid = syscall(SYS_gettid);
	// SA_ONSTACK: a handler may interrupt a goroutine on its small
	// stack; Go gives every thread an alternate one.
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = handover_signal;
	sa.sa_mask = stop;
	sigaddset(&sa.sa_mask, HANDOVER_MARK);
	sa.sa_flags = SA_ONSTACK | SA_RESTART;
	if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0 ||
	    sigaction(SIGHUP, &sa, NULL) != 0)
		return -1;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = handover_block;
	sa.sa_mask = stop;
	sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
	if (sigaction(HANDOVER_MARK, &sa, NULL) != 0)
		return -1;
	// The signals a Go program ignores unless it asks for them (the
	// runtime's sigtable): the supervisor outlived them, and so does
	// the waiter, as an ignored signal stays ignored across an exec.
	// (Not through os/signal, which would reset a thread's mask.)
	static const int go_ignores[] = {SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGXCPU,
					 SIGXFSZ, SIGVTALRM, SIGPROF, SIGIO, SIGPWR};
	for (size_t i = 0; i < sizeof go_ignores / sizeof go_ignores[0]; i++)
		signal(go_ignores[i], SIG_IGN);
	for (int sig = 35; sig <= 64; sig++) // real-time, above glibc's own
		if (sig != HANDOVER_FLUSH)
			signal(sig, SIG_IGN);
	return 0;
}

// sandbox_handover_sweep has every thread but this one block the stop
// signals (handover_block), and returns once they all have: -1 if one
// did not within a second. Threads already swept are left alone, so it
// can be called again for those the Go runtime started since.
int sandbox_handover_sweep(void) {
	static pid_t swept[1024];
	static size_t nswept;
	pid_t pid = getpid();
	for (;;) {
		DIR *d = opendir("/proc/self/task");
		if (d == NULL)
			return -1;
		int before = __atomic_load_n(&handover_acks, __ATOMIC_SEQ_CST), sent = 0;
		for (struct dirent *e; (e = readdir(d)) != NULL;) {
			pid_t tid = (pid_t)atoi(e->d_name);
			if (tid <= 0 || tid == handover_tid)
				continue;
			size_t i = 0;
			while (i < nswept && swept[i] != tid)
				i++;
			if (i < nswept || nswept == sizeof swept / sizeof swept[0])
				continue;
			swept[nswept++] = tid;
			if (syscall(SYS_tgkill, pid, tid, HANDOVER_MARK) == 0)
				sent++;
		}
		closedir(d);
		if (sent == 0)
			return 0;
		for (int waited = 0; __atomic_load_n(&handover_acks, __ATOMIC_SEQ_CST) - before < sent; waited++) {
			if (waited == 10000)
				return -1;
			struct timespec ts = {0, 100000};
			nanosleep(&ts, NULL);
		}
	}
}

// sandbox_handover_end is the last step before the exec: a last sweep,
// then the hand-over's own signals are left as a Go program leaves them
// (HANDOVER_FLUSH ignored, HANDOVER_MARK fatal).
int sandbox_handover_end(void) {
	int err = sandbox_handover_sweep();
	signal(HANDOVER_FLUSH, SIG_IGN);
	signal(HANDOVER_MARK, SIG_DFL);
	return err;
}

// The status the supervisor exits with when the daemon ended with status
// (waitpid's) and stop was the signal passed on to it (0: none). Also in
// Go, reaped in waiter.go, which logs what it means; this one is the
// fallback when the reaped stage cannot be exec'd.
int sandbox_exit_code(int status, int stop) {
	if (stop != 0 && ((WIFSIGNALED(status) && WTERMSIG(status) != SIGSYS) ||
			  (WIFEXITED(status) && WEXITSTATUS(status) == GO_SIGNAL_EXIT)))
		return 0;
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return WEXITSTATUS(status);
}

// The waiter.

// env_long is the positive number in the environment variable name, or -1.
static long env_long(const char *name) {
	const char *s = getenv(name);
	if (s == NULL || *s == '\0')
		return -1;
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno != 0 || *end != '\0' || v <= 0)
		return -1;
	return v;
}

// waiter_signals is the set of signals the waiter takes: the stop signals
// and SIGCHLD.
static void waiter_signals(sigset_t *set) {
	sigemptyset(set);
	stop_signals(set);
	sigaddset(set, SIGCHLD);
}

static int64_t now_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// exec_reaped execs the binary again as the reaped stage, which learns
// from its environment how the daemon ended (see reaped in waiter.go):
// status is waitpid's (-1: the daemon was lost), stop the signal passed on
// (0: none), killed whether the grace period ran out.
static void exec_reaped(char **argv, int status, int stop, int killed) __attribute__((noreturn));
static void exec_reaped(char **argv, int status, int stop, int killed) {
	static char vstage[64], vstatus[64], vstop[64], vkilled[64];
	snprintf(vstage, sizeof vstage, "%s=%s", ENV_STAGE, STAGE_REAPED);
	snprintf(vstatus, sizeof vstatus, "%s=%d", ENV_STATUS, status);
	snprintf(vstop, sizeof vstop, "%s=%d", ENV_STOP, stop);
	snprintf(vkilled, sizeof vkilled, "%s=%d", ENV_KILLED, killed);
	// Our environment with the stage replaced, plus these.
	size_t n = 0;
	while (environ[n] != NULL)
		n++;
	char **env = malloc((n + 5) * sizeof *env);
	if (env != NULL) {
		size_t j = 0;
		for (size_t i = 0; i < n; i++) {
			if (strncmp(environ[i], ENV_STAGE "=", strlen(ENV_STAGE) + 1) != 0)
				env[j++] = environ[i];
		}
		env[j++] = vstage;
		env[j++] = vstatus;
		env[j++] = vstop;
		env[j++] = vkilled;
		env[j] = NULL;
		// A stop signal that came after the daemon ended is for no
		// one; the Go runtime would die of one that comes before
		// main registers for them. Ignored until then (a pending one
		// is dropped).
		signal(SIGTERM, SIG_IGN);
		signal(SIGINT, SIG_IGN);
		signal(SIGHUP, SIG_IGN);
		sigset_t all;
		waiter_signals(&all);
		sigprocmask(SIG_UNBLOCK, &all, NULL);
		execve("/proc/self/exe", argv, env);
		fprintf(stderr, "govirtiofsd: exec of the reaped stage: %s\n", strerror(errno));
	}
	_exit(status == -1 ? 1 : sandbox_exit_code(status, stop));
}

// wait_for_daemon waits for the daemon (ENV_PID) to end. The first stop
// signal is passed on to it, again every ENV_RESEND ms (the init of a PID
// namespace drops one it has no handler for yet), and after ENV_GRACE ms
// it is killed. Signals are taken with sigtimedwait: no handler, no race.
static void wait_for_daemon(char **argv) __attribute__((noreturn));
static void wait_for_daemon(char **argv) {
	sigset_t set;
	waiter_signals(&set);
	// Stop signals are blocked already (handover), and any that came
	// during the hand-over are pending.
	sigprocmask(SIG_BLOCK, &set, NULL);
	long pid = env_long(ENV_PID), resend_ms = env_long(ENV_RESEND), grace_ms = env_long(ENV_GRACE);
	if (pid < 0 || resend_ms < 0 || grace_ms < 0) {
		fprintf(stderr, "govirtiofsd: %s, %s or %s missing\n", ENV_PID, ENV_RESEND, ENV_GRACE);
		_exit(1);
	}
	int stop = 0, killed = 0, status = 0;
	int64_t next = 0, deadline = 0; // next resend; end of the grace period
	for (;;) {
		// First: the SIGCHLD of a daemon that ended before the
		// exec was not blocked, and is lost.
		pid_t r = waitpid((pid_t)pid, &status, WNOHANG);
		if (r == (pid_t)pid)
			break;
		if (r < 0 && errno != EINTR)
			exec_reaped(argv, -1, stop, killed);
		struct timespec tick = {resend_ms / 1000, (resend_ms % 1000) * 1000000};
		int sig = sigtimedwait(&set, NULL, stop != 0 && !killed ? &tick : NULL);
		int64_t now = now_ns();
		if (stop == 0 && (sig == SIGTERM || sig == SIGINT || sig == SIGHUP)) {
			stop = sig;
			kill((pid_t)pid, stop);
			next = now + resend_ms * 1000000;
			deadline = now + grace_ms * 1000000;
		} else if (stop != 0 && !killed && now >= deadline) {
			// It would keep its guest's requests and the socket's
			// name: the reaped stage warns.
			kill((pid_t)pid, SIGKILL);
			killed = 1;
		} else if (stop != 0 && !killed && now >= next) {
			kill((pid_t)pid, stop);
			next = now + resend_ms * 1000000;
		}
	}
	exec_reaped(argv, status, stop, killed);
}

// sandbox_wait_stage runs before main, as glibc runs constructors: with
// argc, argv and envp.
__attribute__((constructor)) static void sandbox_wait_stage(int argc, char **argv, char **envp) {
	(void)argc;
	(void)envp;
	const char *stage = getenv(ENV_STAGE);
	if (stage == NULL || (strcmp(stage, STAGE_WAIT) != 0 && strcmp(stage, STAGE_REAPED) != 0))
		return;
	// The name tools like pgrep know the supervisor by.
	const char *comm = getenv(ENV_COMM);
	if (comm != NULL)
		prctl(PR_SET_NAME, comm, 0, 0, 0);
	if (strcmp(stage, STAGE_WAIT) == 0)
		wait_for_daemon(argv);
}
