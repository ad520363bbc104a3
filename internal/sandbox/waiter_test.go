package sandbox

import (
	"bufio"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Environment of the test binary run as a supervisor by TestWaiter.
const (
	waiterTestScript = "GOVIRTIOFSD_WAITERTEST_SCRIPT" // the daemon: a shell script
	waiterTestEarly  = "GOVIRTIOFSD_WAITERTEST_EARLY"  // "1": a SIGTERM is in Go's hands at the hand-over
)

func TestMain(m *testing.M) {
	switch {
	case Reaped():
		// The waiter's exec once the daemon has ended.
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
		code, err := reaped(Config{Log: log})
		fmt.Fprintf(os.Stderr, "reaped: exit %d, error %v\n", code, err)
		os.Exit(code)
	case os.Getenv(waiterTestScript) != "":
		superviseScript(os.Getenv(waiterTestScript), os.Getenv(waiterTestEarly) == "1")
	}
	os.Exit(m.Run())
}

// superviseScript is the supervisor's part as supervise plays it: it starts
// the daemon (script, which says "ready" once its traps are set) from a
// locked thread and hands the waiting over.
func superviseScript(script string, early bool) {
	runtime.LockOSThread()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		err = cmd.Start()
	}
	if err == nil {
		_, err = bufio.NewReader(out).ReadString('\n')
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "supervisor:", err)
		os.Exit(99)
	}
	if early {
		// Caught by Go's handler: on its way to sigs when the hand-over
		// begins, or there already.
		syscall.Kill(os.Getpid(), syscall.SIGTERM)
	}
	stopResend, stopGrace = 5*time.Millisecond, 300*time.Millisecond
	err = handOver(Config{}, cmd.Process.Pid, sigs, nil, "/")
	fmt.Fprintln(os.Stderr, "supervisor:", err)
	os.Exit(99)
}

// supervisorCmd runs the test binary as the supervisor of script
// (superviseScript).
func supervisorCmd(script string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	// The race runtime's exit pause (a second) only slows the runs.
	cmd.Env = append(os.Environ(), waiterTestScript+"="+script,
		"GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	return cmd
}

// TestWaiter runs the supervisor's hand-over to the C waiter and the
// reaped stage for real: the test binary supervises a shell script. The
// daemon survives the exec (no parent-death signal), a stop signal is
// passed on and repeated until the daemon is gone, one the daemon ignores
// ends in a SIGKILL after the grace period, one already in Go's hands at
// the hand-over is not lost, and the supervisor exits with the status
// reaped computes, logging what it logs.
func TestWaiter(t *testing.T) {
	if Resumed() || Reaped() {
		t.Skip("inside a sandbox stage")
	}
	loop := `while :; do sleep 0.01; done`
	for _, tc := range []struct {
		name   string
		script string
		early  bool // a SIGTERM in Go's hands at the hand-over
		others bool // signals a Go program ignores to the waiter first
		stop   bool // a SIGTERM to the waiter
		code   int
		log    []string
	}{
		{name: "exit", script: `echo ready; sleep 0.3; exit 3`, code: 3},
		// Counts the signals it takes and exits at the third: only a
		// repeated signal ends it.
		{name: "repeated", script: `n=0; trap 'n=$((n+1)); [ $n -ge 3 ] && exit 7' TERM; echo ready; ` + loop,
			stop: true, code: 7},
		{name: "killed-by-stop", script: `echo ready; ` + loop, stop: true, code: 0,
			log: []string{`msg="sandboxed daemon stopped"`, `status="signal: terminated"`}},
		{name: "ignored", script: `trap '' TERM; echo ready; ` + loop, stop: true, code: 0,
			log: []string{`level=WARN msg="sandboxed daemon did not stop; killing it"`, "signal=terminated after=300ms",
				`status="signal: killed"`}},
		{name: "outlives-others", script: `trap 'exit 0' TERM; echo ready; ` + loop, others: true, stop: true, code: 0},
		{name: "early", script: `trap 'exit 0' TERM; echo ready; ` + loop, early: true, code: 0},
		{name: "sigsys", script: `echo ready; sleep 0.3; kill -SYS $$`, code: 128 + int(syscall.SIGSYS),
			log: []string{`level=ERROR msg="sandboxed daemon killed by signal SIGSYS: a system call outside the seccomp allowlist (find it with --seccomp log or trap)" pid=`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := supervisorCmd(tc.script)
			if tc.early {
				cmd.Env = append(cmd.Env, waiterTestEarly+"=1")
			}
			out, err := os.Create(t.TempDir() + "/out")
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			cmd.Stdout, cmd.Stderr = out, out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			pid := cmd.Process.Pid
			// The waiter: the same process, in C.
			waiting := false
			for deadline := time.Now().Add(10 * time.Second); !waiting && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
				env, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
				waiting = strings.Contains("\x00"+string(env), "\x00"+envStage+"="+stageWait+"\x00")
			}
			if waiting {
				// Its name is the supervisor's (once its constructor
				// runs), not "exe".
				want, comm := filepath.Base(os.Args[0]), ""
				for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
					b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
					if comm = strings.TrimSpace(string(b)); comm != "" && strings.HasPrefix(want, comm) {
						break
					}
				}
				if comm != "" && !strings.HasPrefix(want, comm) { // "": gone already
					t.Errorf("the waiter is named %q, want %q", comm, want)
				}
				// Its footprint once the constructor runs: the environment
				// names the stage from the exec on, while the loader may
				// still be mapping and relocating, so the least of a few
				// samples is the waiter's own.
				kb := rssAnon(pid)
				for deadline := time.Now().Add(500 * time.Millisecond); kb > 512 && time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
					if k := rssAnon(pid); k > 0 && k < kb {
						kb = k
					}
				}
				if kb > 512 {
					t.Errorf("the waiter holds %d KiB of anonymous memory", kb)
				} else {
					t.Logf("the waiter: RssAnon %d KiB", kb)
				}
			} else if tc.name != "exit" && tc.name != "sigsys" {
				t.Fatalf("no wait stage:\n%s", output(out))
			}
			if tc.others {
				for _, sig := range []syscall.Signal{syscall.SIGUSR1, syscall.SIGPIPE, syscall.SIGALRM, syscall.Signal(50)} {
					syscall.Kill(pid, sig)
				}
				time.Sleep(10 * time.Millisecond)
			}
			if tc.stop {
				syscall.Kill(pid, syscall.SIGTERM)
			}
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				cmd.Process.Kill()
				<-done
				t.Fatalf("still running:\n%s", output(out))
			}
			got := output(out)
			if code := cmd.ProcessState.ExitCode(); code != tc.code || !strings.Contains(got, "reaped: exit "+strconv.Itoa(tc.code)+", error <nil>") {
				t.Errorf("exit %d, want %d:\n%s", code, tc.code, got)
			}
			for _, l := range tc.log {
				if !strings.Contains(got, l) {
					t.Errorf("no %q in the log:\n%s", l, got)
				}
			}
		})
	}
}

// TestExitCodes: the waiter's fallback status, in C, is reaped's.
func TestExitCodes(t *testing.T) {
	exited := func(n int) syscall.WaitStatus { return syscall.WaitStatus(n << 8) }
	killed := func(s syscall.Signal) syscall.WaitStatus { return syscall.WaitStatus(s) }
	for _, tc := range []struct {
		ws   syscall.WaitStatus
		stop syscall.Signal
		want int
	}{
		{exited(0), 0, 0},
		{exited(3), 0, 3},
		{exited(2), 0, 2},
		{exited(2), syscall.SIGTERM, 0},
		{exited(1), syscall.SIGTERM, 1},
		{killed(syscall.SIGKILL), 0, 137},
		{killed(syscall.SIGKILL), syscall.SIGINT, 0},
		{killed(syscall.SIGTERM), syscall.SIGTERM, 0},
		{killed(syscall.SIGSYS), 0, 159},
		{killed(syscall.SIGSYS), syscall.SIGHUP, 159},
		{killed(syscall.SIGSEGV) | 0x80, 0, 139}, // core dumped
	} {
		if got := exitCode(tc.ws, tc.stop); got != tc.want {
			t.Errorf("exitCode(%#x, %v) = %d, want %d", int(tc.ws), tc.stop, got, tc.want)
		}
		if got := waiterExitCode(tc.ws, tc.stop); got != tc.want {
			t.Errorf("sandbox_exit_code(%#x, %d) = %d, want %d", int(tc.ws), int(tc.stop), got, tc.want)
		}
	}
}

// TestWaiterHandOverRace: a stop signal that comes at any moment of the
// hand-over (here the daemon's own, sent to its supervisor from 0 to 10 ms
// after it says it is ready, as the supervisor starts the hand-over) is
// passed on: the daemon exits when it gets one, and the test times out if
// it never does.
func TestWaiterHandOverRace(t *testing.T) {
	if Resumed() || Reaped() {
		t.Skip("inside a sandbox stage")
	}
	n := 40
	if testing.Short() {
		n = 10
	}
	for i := range n {
		delay := fmt.Sprintf("%.4f", float64(i%20)*0.0005)
		cmd := supervisorCmd(`trap 'exit 0' TERM; echo ready; sleep ` + delay + `; kill -TERM $PPID; while :; do sleep 0.01; done`)
		out, err := os.Create(t.TempDir() + "/out")
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			cmd.Wait()
			close(done)
		}()
		select {
		case <-done:
			if code := cmd.ProcessState.ExitCode(); code != 0 {
				t.Errorf("run %d, stop %s s after ready: exit %d, want 0:\n%s", i, delay, code, output(out))
			}
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Fatalf("run %d, stop %s s after ready: the stop signal was lost:\n%s", i, delay, output(out))
		}
		out.Close()
	}
}

// rssAnon is RssAnon of pid in KiB (-1 if unreadable).
func rssAnon(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "RssAnon:"); ok {
			n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			return n
		}
	}
	return -1
}

func output(f *os.File) string {
	b, _ := os.ReadFile(f.Name())
	return string(b)
}
