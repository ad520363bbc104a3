package integration

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestCPUProfile: with GOVIRTIOFSD_CPUPROFILE the daemon writes a Go CPU
// profile of its serving process (in whichever sandbox it runs), complete
// once the front end has disconnected; under the seccomp filter that
// kills, whose allowlist lacks the profiler's timers, it refuses to start.
func TestCPUProfile(t *testing.T) {
	t.Run("written", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "cpu.pprof")
		d := startDaemonWith(t, daemonSpec{env: []string{"GOVIRTIOFSD_CPUPROFILE=" + path}}, "--seccomp", "none")
		dev := d.connect(opts())
		c := newFS(t, dev, 1)
		c.mount()
		for i := range 20 {
			c.roundTrip(d, fmt.Sprintf("f%d", i), bytes.Repeat([]byte{byte(i)}, 256<<10))
		}
		d.disconnect()
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		z, err := gzip.NewReader(f)
		if err != nil {
			t.Fatalf("profile is not gzip data, as pprof writes: %v", err)
		}
		b, err := io.ReadAll(z)
		if err != nil {
			t.Fatalf("profile truncated (not stopped at exit?): %v", err)
		}
		// The sample types of a Go CPU profile, in its string table.
		for _, s := range []string{"samples", "count", "cpu", "nanoseconds"} {
			if !bytes.Contains(b, []byte(s)) {
				t.Errorf("profile (%d bytes) lacks %q: not a CPU profile", len(b), s)
			}
		}
	})
	t.Run("trace-written", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "exec.trace")
		d := startDaemonWith(t, daemonSpec{env: []string{"GOVIRTIOFSD_TRACE=" + path}}, "--seccomp", "none")
		dev := d.connect(opts())
		c := newFS(t, dev, 1)
		c.mount()
		c.roundTrip(d, "f", bytes.Repeat([]byte{1}, 64<<10))
		d.disconnect()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		// A Go execution trace starts with its version line.
		if !bytes.HasPrefix(b, []byte("go 1.")) || len(b) < 1024 {
			t.Errorf("trace (%d bytes) does not look like a Go execution trace: %q", len(b), b[:min(len(b), 16)])
		}
	})
	t.Run("refused-under-seccomp-kill", func(t *testing.T) {
		dir := t.TempDir()
		path := filepath.Join(dir, "cpu.pprof")
		cmd := exec.Command(daemonBin, "--socket-path", filepath.Join(dir, "s.sock"), "--shared-dir", dir,
			"--sandbox", "none", "--seccomp", "kill")
		cmd.Env = append(os.Environ(), "GOVIRTIOFSD_CPUPROFILE="+path)
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Fatalf("daemon served with a profile under --seccomp kill; output:\n%s", out)
		}
		if !strings.Contains(string(out), "needs --seccomp none or log") {
			t.Errorf("refusal does not say why:\n%s", out)
		}
		if _, err := os.Stat(path); err == nil {
			t.Error("profile file created although the daemon refused to start")
		}
	})
}
