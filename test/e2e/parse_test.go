//go:build linux

package e2e

import (
	"bytes"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The parsers run without root or QEMU.

func TestParseLogfmt(t *testing.T) {
	line := `time=2026-11-30T09:32:06.850Z level=DEBUG msg="fuse request" queue=1 unique=2 opcode=INIT nodeid=0 len=104 error=-38 latency=146.597µs note="a \"q\" b"`
	got := parseLogfmt(line)
	want := map[string]string{
		"time": "2026-11-30T09:32:06.850Z", "level": "DEBUG", "msg": "fuse request", "queue": "1", "unique": "2",
		"opcode": "INIT", "nodeid": "0", "len": "104", "error": "-38", "latency": "146.597µs", "note": `a "q" b`,
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseLogfmt:\n got %v\nwant %v", got, want)
	}
	if kv := parseLogfmt("# /bin/govirtiofsd --socket-path x"); kv["msg"] != "" {
		t.Fatalf("comment line parsed as %v", kv)
	}
}

func TestParseConsole(t *testing.T) {
	lines := []string{
		"SeaBIOS", "\x1bc\x1b[?7l\x1b[2JE2E-BOOT kernel=6.1.0-57-cloud-amd64 uptime=3.1",
		"E2E-STEP-BEGIN mount", "E2E-STEP mount rc=0", "E2E-MOUNTED tag=myfs uptime=3.2",
		"E2E-STEP-BEGIN cat", "cat: can't open '/mnt/hello': Connection refused", "E2E-STEP cat rc=1",
		"E2E-ASK next", "E2E-ANSWER reboot", "E2E-DONE action=reboot uptime=3.5",
		"E2E-BOOT kernel=6.1.0-57-cloud-amd64 uptime=3.0",
		"E2E-STEP-BEGIN cat", "hello", "E2E-STEP cat rc=0",
	}
	g := parseConsole(lines)
	if g.Boots != 2 || !reflect.DeepEqual(g.Uptimes, []string{"3.2"}) || !reflect.DeepEqual(g.Done, []string{"reboot"}) {
		t.Fatalf("parseConsole: %+v", g)
	}
	want := []guestStep{
		{Boot: 1, Name: "mount", RC: 0},
		{Boot: 1, Name: "cat", RC: 1, Output: []string{"cat: can't open '/mnt/hello': Connection refused"}},
		{Boot: 2, Name: "cat", RC: 0, Output: []string{"hello"}},
	}
	if !reflect.DeepEqual(g.Steps, want) {
		t.Fatalf("steps:\n got %+v\nwant %+v", g.Steps, want)
	}
}

func TestParseFioTerse(t *testing.T) {
	// Fields 1-9 then zeros up to the write group (47-50), as fio 3.33 prints them.
	f := make([]string, 130)
	for i := range f {
		f[i] = "0"
	}
	f[0], f[1], f[2], f[4] = "3", "fio-3.33", "j", "0"
	f[5], f[6], f[7], f[8] = "32768", "71545", "69.5", "458"
	f[46], f[47], f[48], f[49] = "8192", "6517", "1629", "1257"
	f[23], f[29] = "50.000000%=64", "99.000000%=123" // read clat percentiles
	f[46+18], f[46+24] = "50.000000%=245", "99.000000%=1417"
	line := strings.Join(f, ";")
	r, err := parseFioTerse("seq-1m-direct-read", line)
	if err != nil || r.KiB != 32768 || r.BWKiB != 71545 || r.IOPS != 69.5 || r.RuntimeMS != 458 || r.P50us != 64 || r.P99us != 123 {
		t.Fatalf("read pass: %+v, %v", r, err)
	}
	w, err := parseFioTerse("rand-4k-direct-write", line)
	if err != nil || w.KiB != 8192 || w.BWKiB != 6517 || w.IOPS != 1629 || w.RuntimeMS != 1257 || w.P50us != 245 || w.P99us != 1417 {
		t.Fatalf("write pass: %+v, %v", w, err)
	}
	if _, err := parseFioTerse("x-read", "3;fio;x;0;0"); err == nil {
		t.Fatal("short line accepted")
	}
	if m := reFio.FindStringSubmatch("E2E-FIO seq-1m-direct-read " + line); m == nil || m[1] != "seq-1m-direct-read" {
		t.Fatalf("reFio: %q", m)
	}
}

func TestParseResultLines(t *testing.T) {
	cases := map[string][2]string{
		"E2E-RESULT create.read hello":                  {"create.read", "hello"},
		"E2E-RESULT tmpfile.dir ":                       {"tmpfile.dir", ""},
		"E2E-RESULT tmpfile.dir":                        {"tmpfile.dir", ""},
		"\x1b[2JE2E-RESULT statx basic=1 mode=100604 x": {"statx", "basic=1 mode=100604 x"},
	}
	for line, want := range cases {
		m := reResult.FindStringSubmatch(line)
		if m == nil || m[1] != want[0] || m[2] != want[1] {
			t.Errorf("%q: %q, want %q", line, m, want)
		}
	}
	if m := reMismatch.FindStringSubmatch("E2E-MISMATCH a.b got=[1] want=[2]"); m == nil || m[1] != "a.b" {
		t.Errorf("reMismatch: %q", m)
	}
}

// The tables the side-by-side comparison relies on are complete.
func TestDifferenceTables(t *testing.T) {
	for k, d := range intendedDifferences {
		if d.Reason == "" || d.Ours == d.Reference {
			t.Errorf("intendedDifferences[%q]: needs a reason and two different values: %+v", k, d)
		}
	}
	for k, reason := range KnownFailures {
		if reason == "" {
			t.Errorf("KnownFailures[%q]: no reason", k)
		}
	}
}

// TestSoakVerdict: the soak's growth criterion on made-up series (no root).
func TestSoakVerdict(t *testing.T) {
	var fds, rss soakMetric
	for _, m := range soakMetrics {
		switch m.Name {
		case "fds":
			fds = m
		case "rss_anon":
			rss = m
		}
	}
	// One idle sample a minute for an hour, shaped by f(minute).
	series := func(f func(i int) (fds, rssKiB int64)) []soakSample {
		var out []soakSample
		for i := 0; i <= 60; i++ {
			n, r := f(i)
			out = append(out, soakSample{Kind: "idle", At: time.Duration(i) * time.Minute, FDs: n, RssAnon: r})
		}
		return out
	}
	const hour = time.Hour
	for _, c := range []struct {
		name            string
		f               func(i int) (int64, int64)
		fdsOK, rssOK    bool
		fdsSlopePerHour float64
	}{
		{"flat", func(int) (int64, int64) { return 40, 30 << 10 }, true, true, 0},
		// Warm-up growth in the first half is not judged.
		{"warm-up then flat", func(i int) (int64, int64) { return int64(min(i, 30)) + 20, int64(min(i, 30)) << 20 }, true, true, 0},
		// Noise (a sawtooth of +-10 fds, +-3 MiB) without a trend.
		{"sawtooth", func(i int) (int64, int64) { return 40 + int64(i%5*5) - 10, 30<<10 + int64(i%7-3)<<10 }, true, true, math.NaN()},
		// One fd per minute: 30 over the second half > 16.
		{"fd leak", func(i int) (int64, int64) { return 40 + int64(i), 30 << 10 }, false, true, 60},
		// 200 KiB a minute: 6 MiB over the second half, > 4 MiB and > 10% of ~33 MiB.
		{"rss leak", func(i int) (int64, int64) { return 40, 30<<10 + int64(i)*200 }, true, false, 0},
		// 100 KiB a minute on 300 MiB: 3 MiB, under both limits.
		{"slow rss growth", func(i int) (int64, int64) { return 40, 300<<10 + int64(i)*100 }, true, true, 0},
	} {
		s := series(c.f)
		sf := analyzeSoak(s, "idle", 0, hour, fds)
		sr := analyzeSoak(s, "idle", 0, hour, rss)
		if sf.Failed == c.fdsOK || sr.Failed == c.rssOK {
			t.Errorf("%s: fds failed=%v (growth %.1f, limit %.1f), rss failed=%v (growth %.0f KiB, limit %.0f KiB); want fds ok=%v, rss ok=%v",
				c.name, sf.Failed, sf.Growth, sf.Limit, sr.Failed, sr.Growth, sr.Limit, c.fdsOK, c.rssOK)
		}
		if !math.IsNaN(c.fdsSlopePerHour) && math.Abs(sf.SlopePerHour-c.fdsSlopePerHour) > 1e-6 {
			t.Errorf("%s: fds slope %.3f/h, want %.3f", c.name, sf.SlopePerHour, c.fdsSlopePerHour)
		}
		if sf.N != 61 || sf.Fit != 31 {
			t.Errorf("%s: %d samples, %d in the fit; want 61 and 31", c.name, sf.N, sf.Fit)
		}
	}
	// Periodic samples do not judge fds; too few samples to fit is a failure.
	s := series(func(i int) (int64, int64) { return 40 + int64(i), 30 << 10 })
	for i := range s {
		s[i].Kind = "periodic"
	}
	if st := analyzeSoak(s, "periodic", 0, hour, fds); st.Failed || st.Judged {
		t.Errorf("periodic fds judged: %+v", st)
	}
	if st := analyzeSoak(s[:1], "periodic", 0, hour, rss); !st.Failed {
		t.Errorf("one sample passed: %+v", st)
	}
}

// TestBootCrashPatterns: a boot crash is retried only when nothing in its
// trace is the shared file system's device or FUSE code.
func TestBootCrashPatterns(t *testing.T) {
	for _, tc := range []struct {
		line          string
		crash, device bool
	}{
		{"[    0.412345] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI", true, false},
		{"[    0.412345] Kernel panic - not syncing: Fatal exception", true, false},
		{"[    0.412345] RIP: 0010:sched_clock_cpu+0x10/0x1a0", false, false},
		{"[    0.412345] Modules linked in: virtiofs fuse virtio_pci", false, false},
		{"[    0.412345]  virtio_fs_probe+0x1a/0x30 [virtiofs]", false, true},
		{"[    0.412345]  ? __virtqueue_add_split+0x5/0x10", false, true},
		{"[    0.412345] RIP: 0010:vp_notify+0x12/0x20", false, true},
		{"[    0.412345]  fuse_fill_super+0x40/0x90", false, true},
		{"E2E-BOOT kernel=6.12.57 uptime=1.02", false, false},
	} {
		if got := reBootCrash.MatchString(tc.line); got != tc.crash {
			t.Errorf("%q: crash %v, want %v", tc.line, got, tc.crash)
		}
		if got := reDeviceCrash.MatchString(tc.line); got != tc.device {
			t.Errorf("%q: device crash %v, want %v", tc.line, got, tc.device)
		}
	}
}

func TestCompactSequence(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", ""},
		{"A", "A"},
		{"A A A B", "Ax3 B"},
		{"A B C D B C D B C D E", "A (B C D)x3 E"},
		{"SET_VRING_CALL SET_VRING_ERR SET_VRING_CALL SET_VRING_ERR", "(SET_VRING_CALL SET_VRING_ERR)x2"},
		{"A B A C", "A B A C"},
	} {
		if got := compactSequence(strings.Fields(c.in)); got != c.want {
			t.Errorf("compactSequence(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestParseMigReport(t *testing.T) {
	lines := []string{
		"E2E-MIG-CHECK read-0 ok",
		"E2E-MIG-FIO pass=1 rc=0 phase=0 endphase=0 uptime=8.50",
		"E2E-MIG-FIO pass=2 rc=1 phase=0 endphase=1 uptime=11.27",
		"E2E-MIG-CHECK read-1 ok status=completed",
		"E2E-MIG-CHECK read-1 fail status=completed",
		"E2E-MIG-UNLINKED rc=1 out=dd:_standard_input:_Input/output_error",
		"E2E-MIG-END appended=350 fio_passes=2 fio_failed=1 failed=1",
	}
	r := parseMigReport(lines)
	if !reflect.DeepEqual(r.order, []string{"read-0", "read-1", "read-1#2"}) || r.checks["read-1"] != "ok status=completed" ||
		r.checks["read-1#2"] != "fail status=completed" {
		t.Errorf("checks: %v %v", r.order, r.checks)
	}
	if want := []migFioPass{{1, 0, 0, 0}, {2, 1, 0, 1}}; !reflect.DeepEqual(r.fio, want) {
		t.Errorf("fio: %+v, want %+v", r.fio, want)
	}
	if len(r.ends) != 1 || r.ends[0]["appended"] != "350" || r.ends[0]["failed"] != "1" {
		t.Errorf("ends: %v", r.ends)
	}
	if r.unlinked == nil || r.unlinked.rc != 1 || !strings.Contains(r.unlinked.out, "Input/output_error") {
		t.Errorf("unlinked: %+v", r.unlinked)
	}
}

func TestGuestConsoleJoin(t *testing.T) {
	a := &vm{lines: []string{"E2E-BOOT kernel=k uptime=1", "E2E-MIG-FI"}, partial: true}
	b := &vm{lines: []string{"O pass=1 rc=0 phase=0 endphase=1 uptime=2", "E2E-DONE action=poweroff uptime=3"}}
	c := newGuestConsole(t, a)
	c.moveTo(b)
	want := []string{"E2E-BOOT kernel=k uptime=1", "E2E-MIG-FIO pass=1 rc=0 phase=0 endphase=1 uptime=2", "E2E-DONE action=poweroff uptime=3"}
	if got := c.lines(); !reflect.DeepEqual(got, want) {
		t.Errorf("lines:\n got %q\nwant %q", got, want)
	}
}

func TestForeignNodeIDs(t *testing.T) {
	req := func(op, node string) fuseRequest { return fuseRequest{Opcode: op, NodeID: node} }
	entry := func(op, node, e string) fuseRequest { return fuseRequest{Opcode: op, NodeID: node, Entry: e} }
	src := []fuseRequest{req("INIT", "0"), entry("LOOKUP", "1", "7"), req("OPEN", "7"), req("READ", "7"), req("WRITE", "9"),
		entry("CREATE", "1", "20")}
	dst := []fuseRequest{req("READ", "7"), req("WRITE", "9"), req("GETATTR", "1"), req("WRITE", "12"), req("FLUSH", "12"),
		req("GETATTR", "20"),                           // handed out by the source's CREATE
		entry("CREATE", "1", "30"), req("WRITE", "30"), // made on the destination
		req("INIT", "0"), req("READ", "44")} // after a new INIT: not judged
	foreign, rw := foreignNodeIDs(src, dst)
	if !reflect.DeepEqual(foreign, []string{"WRITE:12", "FLUSH:12"}) || !reflect.DeepEqual(rw, []string{"12", "30", "7", "9"}) {
		t.Errorf("foreignNodeIDs: foreign %v, read/write %v", foreign, rw)
	}
}

// TestReadQEMUTrace: both trace line formats (QEMU 10's PID@SEC.USEC: and
// QEMU 11's RFC 3339 time) give the same events.
func TestReadQEMUTrace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace.log")
	data := "2436@1796308370.397673:vhost_user_write req:1 flags:0x1\n" +
		"2026-12-03T19:37:13.720217Z vhost_user_write req:15 (GET_PROTOCOL_FEATURES) flags:0x1\n" +
		"2026-12-03T19:37:13.720300Z vhost_dev_start_in dev 0x1 device vhost-user-fs\n" +
		"not a trace line\n"
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	evs := readQEMUTrace(t, path)
	if len(evs) != 3 {
		t.Fatalf("%d events, want 3: %+v", len(evs), evs)
	}
	if got := vhostTraceNames(evs, time.Time{}, time.Time{}); strings.Join(got, " ") != "GET_FEATURES GET_PROTOCOL_FEATURES [dev-start]" {
		t.Errorf("names %v", got)
	}
	if want := time.Date(2026, 12, 3, 19, 37, 13, 720217000, time.UTC); !evs[1].At.Equal(want) {
		t.Errorf("time %v, want %v", evs[1].At, want)
	}
}

// TestGenStreamMatchesFsops: the host's genStream (dax_test.go) gives the
// bytes guest-tools/fsops.c's `gen` gives (TestDAX compares their sha256).
func TestGenStreamMatchesFsops(t *testing.T) {
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("no gcc")
	}
	bin := filepath.Join(t.TempDir(), "fsops")
	if out, err := exec.Command("gcc", "-O2", "-o", bin, filepath.Join(testDir, "guest-tools", "fsops.c")).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	for _, n := range []int64{0, 1, 7, 8, 9, 4095, 65537, 2<<20 + 1} {
		out, err := exec.Command(bin, "gen", "2", strconv.FormatInt(n, 10)).Output()
		if err != nil {
			t.Fatal(err)
		}
		var want bytes.Buffer
		if err := genStream(&want, 2, n); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, want.Bytes()) {
			t.Errorf("gen 2 %d: fsops and genStream differ (%d and %d bytes)", n, len(out), want.Len())
		}
	}
}
