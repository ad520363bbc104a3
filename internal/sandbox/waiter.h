// The waiter's interface with Go (waiter.c, waiter.go). Go reads these
// names through cgo: one spelling for both sides.

#ifndef GOVIRTIOFSD_SANDBOX_WAITER_H
#define GOVIRTIOFSD_SANDBOX_WAITER_H

#define ENV_STAGE "GOVIRTIOFSD_SANDBOX_STAGE"
#define STAGE_WAIT "wait"
#define STAGE_REAPED "reaped"

// The supervisor's name (/proc/PID/comm): an exec of /proc/self/exe would
// make it "exe".
#define ENV_COMM "GOVIRTIOFSD_SANDBOX_COMM"

// For the waiter: the daemon's pid, how often a stop signal is repeated and
// how long the daemon may take to stop, in milliseconds (the latter for the
// reaped stage's report too).
#define ENV_PID "GOVIRTIOFSD_SANDBOX_PID"
#define ENV_RESEND "GOVIRTIOFSD_SANDBOX_RESEND_MS"
#define ENV_GRACE "GOVIRTIOFSD_SANDBOX_GRACE_MS"

// For the reaped stage: waitpid's status of the daemon (-1: lost), the stop
// signal passed on to it (0: none), 1 if it was killed after the grace
// period.
#define ENV_STATUS "GOVIRTIOFSD_SANDBOX_STATUS"
#define ENV_STOP "GOVIRTIOFSD_SANDBOX_STOP"
#define ENV_KILLED "GOVIRTIOFSD_SANDBOX_KILLED"

// The status a Go program exits with when a signal it has not registered
// for would end it and cannot (goSignalExit in sandbox.go).
#define GO_SIGNAL_EXIT 2

// The hand-over's own signals. HANDOVER_FLUSH goes through Go's signal
// queue (handOver): a real-time one no one else sends, above every stop
// signal. HANDOVER_MARK goes to each thread (waiter.c): one no one sends
// and no Go thread blocks (the runtime's sigtable: _SigUnblock).
#define HANDOVER_FLUSH 40
#define HANDOVER_MARK SIGSTKFLT

int sandbox_handover_begin(void);
int sandbox_handover_sweep(void);
int sandbox_handover_end(void);
int sandbox_exit_code(int status, int stop);

#endif
