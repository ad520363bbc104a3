package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestHistQuantiles(t *testing.T) {
	var h hist
	for i := 1; i <= 1000; i++ {
		h.add(int64(i) * 1000) // 1 µs .. 1 ms
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, time.Millisecond}} {
		got := h.quantile(c.q)
		if d := float64(got-c.want) / float64(c.want); d < -0.02 || d > 0.02 {
			t.Errorf("quantile(%v) = %v, want %v ±2%%", c.q, got, c.want)
		}
	}
	for v := uint64(0); v < 1<<30; v = v*3/2 + 1 {
		i := histIndex(v)
		if mid := histValue(i); mid+mid/50 < v || v+v/50+1 < mid {
			t.Fatalf("value %d: bucket %d middle %d", v, i, mid)
		}
	}
}

// TestNullDevice drives the front end against the in-process null device:
// every request completes, no interrupt is lost, and the request path
// does not allocate.
func TestNullDevice(t *testing.T) {
	for _, w := range DefaultWorkloads() {
		if !w.IsIO() {
			continue
		}
		for _, nr := range []int{1, 2} {
			tgt, stop, err := NullTarget(nr, 256, bufMiB(16, w.Size))
			if err != nil {
				t.Fatal(err)
			}
			var m0, m1 runtime.MemStats
			res, err := Run(tgt, RunSpec{Workload: w, Depth: 16, Warmup: 10 * time.Millisecond, Duration: 100 * time.Millisecond,
				OnStart: func() { runtime.ReadMemStats(&m0) },
				OnStop:  func() { runtime.ReadMemStats(&m1) }})
			stop()
			if err != nil {
				t.Fatalf("%s, %d rings: %v", w.Name, nr, err)
			}
			if res.Ops == 0 || res.Withheld != 0 {
				t.Errorf("%s, %d rings: %d ops, %d withheld notifications", w.Name, nr, res.Ops, res.Withheld)
			}
			// The controller and watchdog allocate a little (timers,
			// ReadMemStats); the rings' goroutines must not.
			if per := float64(m1.Mallocs-m0.Mallocs) / float64(res.Ops); per > 0.01 && !raceEnabled {
				t.Errorf("%s, %d rings: %.3f allocations per request", w.Name, nr, per)
			}
			t.Logf("%s, %d rings: %.0f req/s, %d allocations in %d requests", w.Name, nr,
				float64(res.Ops)/res.Elapsed.Seconds(), m1.Mallocs-m0.Mallocs, res.Ops)
		}
	}
}

// TestStalledRunReported: a device that withholds a notification, or stops
// serving, leaves the front end asleep. The run must end with an error
// that says what each side saw, rather than hang.
func TestStalledRunReported(t *testing.T) {
	for _, c := range []struct {
		name   string
		stall  func(d *nullDevice)
		report []string
	}{
		// From the first request on, so that the stall does not depend
		// on how far a loaded machine gets before the run stops.
		{"notification withheld", func(d *nullDevice) { d.maxSignals.Store(0) },
			[]string{"driver asleep", "null device 2: ", " 0 signals"}},
		{"device frozen", func(d *nullDevice) { d.maxServed.Store(0) },
			[]string{"used.idx 0, ", "driver asleep having seen 0,", "null device 2: avail seen 0 "}},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := DefaultWorkloads()[0]
			tgt, stop, err := NullTarget(2, 256, bufMiB(16, w.Size))
			if err != nil {
				t.Fatal(err)
			}
			defer stop()
			c.stall(tgt.null[1])
			done := make(chan error, 1)
			go func() {
				_, err := Run(tgt, RunSpec{Workload: w, Depth: 16, Warmup: 10 * time.Millisecond, Duration: 50 * time.Millisecond,
					StuckAfter: 300 * time.Millisecond})
				done <- err
			}()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("a stalled run did not end")
			}
			if err == nil {
				t.Fatal("a stalled run succeeded")
			}
			for _, want := range append([]string{"not completed", "ring 2: "}, c.report...) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error lacks %q: %v", want, err)
				}
			}
		})
	}
}

// TestCeiling: the machine's ceiling runs each 1 MiB workload's system
// calls on the data files, writes really reach them, and a workload it
// cannot measure or a missing file is an error.
func TestCeiling(t *testing.T) {
	dir := t.TempDir()
	const fileSize = 4 << 20
	old := bytes.Repeat([]byte{0xa5}, fileSize)
	for i := range dataFiles {
		if err := os.WriteFile(filepath.Join(dir, dataName(i)), old, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	measured := 0
	for _, w := range DefaultWorkloads() {
		if !HasCeiling(w) {
			if _, err := Ceiling(dir, fileSize, w, 4, time.Millisecond); err == nil {
				t.Errorf("%s: no error for a workload without a ceiling", w.Name)
			}
			continue
		}
		measured++
		c, err := Ceiling(dir, fileSize, w, 4, 30*time.Millisecond)
		if err != nil {
			t.Fatalf("%s: %v", w.Name, err)
		}
		if c.One <= 0 || c.All <= 0 || c.CPUs != runtime.NumCPU() || c.Best() != max(c.One, c.All) {
			t.Errorf("%s: %+v", w.Name, c)
		}
		if w.Kind == SeqWrite {
			got, err := os.ReadFile(filepath.Join(dir, dataName(0)))
			if err != nil {
				t.Fatal(err)
			}
			if bytes.Equal(got[:w.Size], old[:w.Size]) {
				t.Errorf("%s: the first request's range of %s is unchanged", w.Name, dataName(0))
			}
		}
	}
	if measured != 4 {
		t.Errorf("%d workloads with a ceiling, want the 4 of 1 MiB", measured)
	}
	w := DefaultWorkloads()[1]
	if _, err := Ceiling(dir, uint64(w.Size/2), w, 4, time.Millisecond); err == nil {
		t.Error("no error for files smaller than a request")
	}
	os.Remove(filepath.Join(dir, dataName(3)))
	if _, err := Ceiling(dir, fileSize, w, 4, time.Millisecond); err == nil {
		t.Errorf("%s: no error with %s missing", w.Name, dataName(3))
	}
}
