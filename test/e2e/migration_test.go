//go:build linux

package e2e

import (
	"bufio"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// oursMigrates turns on the migration scenarios with govirtiofsd on both
// sides (ours→ours). Flip it once the daemon migrates (LOG_SHMFD, LOG_ALL,
// DEVICE_STATE: DESIGN.md §10); until then `migrate` is refused at once
// ("Migration disabled: vhost-user backend lacks
// VHOST_USER_PROTOCOL_F_LOG_SHMFD feature"). GOVIRTIOFSD_E2E_MIGRATE_OURS=1
// turns it on for one run. With it on, make e2e (and so make test) runs the
// basic scenario ours→ours instead of Rust→Rust.
const oursMigrates = true

// oursMigratesWithRust turns on the cross pairs (ours→Rust, Rust→ours):
// our stream is the Rust daemon's format, with our trailer after it.
// make e2e runs Rust→ours's basic scenario; e2e-full every scenario of
// both. GOVIRTIOFSD_E2E_MIGRATE_CROSS=1 turns it on for one run.
const oursMigratesWithRust = true

// migPair is the daemon kind of the first QEMU and of the next; a chain of
// migrations alternates them (A→B→A'→B', each with a fresh daemon).
type migPair struct {
	name     string
	src, dst daemonKind
}

func (p migPair) hasRust() bool { return isRust(p.src) || isRust(p.dst) }

func isRust(k daemonKind) bool { return k == rustDaemon || k == rust114Daemon }

func envOn(name string) bool { return os.Getenv(name) == "1" }

func migrationPairs() []migPair {
	ours := oursMigrates || envOn("GOVIRTIOFSD_E2E_MIGRATE_OURS")
	cross := oursMigratesWithRust || envOn("GOVIRTIOFSD_E2E_MIGRATE_CROSS")
	var pairs []migPair
	if ours {
		pairs = append(pairs, migPair{"ours-ours", ourDaemon, ourDaemon})
	}
	if !ours || fullE2E() {
		pairs = append(pairs, migPair{"rust-rust", rustDaemon, rustDaemon})
	}
	switch {
	case cross && fullE2E():
		pairs = append(pairs, migPair{"ours-rust", ourDaemon, rustDaemon}, migPair{"rust-ours", rustDaemon, ourDaemon})
	case cross:
		// make test: an operator switching from the Rust daemon.
		pairs = append(pairs, migPair{"rust-ours", rustDaemon, ourDaemon})
	}
	return pairs
}

// migScenario is one subtest of TestMigration.
type migScenario struct {
	name string
	full bool // only with GOVIRTIOFSD_E2E_FULL=1
	// oursOnly: needs what only our daemon serves (2 request queues).
	oursOnly bool
	run      func(m *migEnv)
}

var migScenarios = []migScenario{
	{name: "basic", run: scenarioMigrateBasic},
	{name: "2queues", full: true, oursOnly: true, run: scenarioMigrate2Queues},
	{name: "rename", full: true, run: scenarioMigrateRename},
	{name: "unlinked-abort", full: true, run: func(m *migEnv) { scenarioMigrateUnlinked(m, "abort") }},
	{name: "unlinked-guest-error", full: true, run: func(m *migEnv) { scenarioMigrateUnlinked(m, "guest-error") }},
	{name: "back-and-forth", full: true, run: scenarioMigrateBackAndForth},
	{name: "cancel", full: true, run: scenarioMigrateCancel},
	{name: "filehandles-unlinked", full: true, run: scenarioMigrateFileHandles},
	{name: "verify-handles", full: true, run: scenarioMigrateVerifyHandles},
	{name: "premount", full: true, run: func(m *migEnv) { scenarioMigrateUnmounted(m, "premount") }},
	{name: "postumount", full: true, run: func(m *migEnv) { scenarioMigrateUnmounted(m, "postumount") }},
	{name: "reboot", full: true, run: scenarioMigrateReboot},
}

// TestMigration live-migrates a Linux 6.12 guest between two QEMU 10
// processes (the destination started with -incoming unix:PATH), each with
// its own daemon on the same shared directory, while the guest works on the
// share (guest-scripts/migrate.sh): it holds one file open for reading and
// one for appending, appends numbered lines in a loop and runs fio write +
// crc32c verify passes back to back, asks the host to migrate, and after
// the host's answer (on the destination's console) checks that both fds
// still work, that no appended line was lost or doubled and that every fio
// pass verified. The host requires status completed, logs `info
// migrate`-style downtime and total time, checks the files on the host, and
// requires both QEMUs and daemons to exit cleanly (the source with `quit`
// after the migration, the destination when the guest powers off). For our
// daemon it also requires that the node ids the destination serves are
// ones the source served (the guest creates no file after migrating).
//
// Pairs (subtests): rust-rust (the Rust virtiofsd 1.13 on both sides,
// --cache never, --log-level debug); ours-ours once oursMigrates (or
// GOVIRTIOFSD_E2E_MIGRATE_OURS=1); ours-rust and rust-ours with
// oursMigratesWithRust (or GOVIRTIOFSD_E2E_MIGRATE_CROSS=1). make e2e runs
// the basic scenario once: ours-ours when enabled, else rust-rust; with
// GOVIRTIOFSD_E2E_FULL=1 every pair runs every scenario (migScenarios).
// GOVIRTIOFSD_E2E_MIGRATE_SCENARIOS (comma-separated names) picks scenarios
// whatever the mode.
func TestMigration(t *testing.T) {
	requireE2E(t)
	peersBin(t, qemu10Wrapper)
	k := newestKernelAtLeast(t, 6, 12, "QEMU 10 runs Linux 6.12 guests only")
	var pick []string
	if s := os.Getenv("GOVIRTIOFSD_E2E_MIGRATE_SCENARIOS"); s != "" {
		pick = strings.Split(s, ",")
		for _, name := range pick {
			if !slices.ContainsFunc(migScenarios, func(sc migScenario) bool { return sc.name == name }) {
				t.Fatalf("GOVIRTIOFSD_E2E_MIGRATE_SCENARIOS: no scenario %q", name)
			}
		}
	}
	start := time.Now()
	migrationMatrix(t, qemu10, k, migrationPairs(), pick)
	if fullE2E() {
		// The same pairs on the late-2026 stack (DESIGN.md §12): Linux 7.x
		// under QEMU 11, the Rust virtiofsd 1.14 in the Rust daemon's place.
		t.Run("qemu11", func(t *testing.T) {
			peersBin(t, qemu11Wrapper)
			var pairs []migPair
			for _, p := range migrationPairs() {
				p.name = strings.ReplaceAll(p.name, "rust", "rust114")
				if p.src == rustDaemon {
					p.src = rust114Daemon
				}
				if p.dst == rustDaemon {
					p.dst = rust114Daemon
				}
				pairs = append(pairs, p)
			}
			migrationMatrix(t, qemu11, newestKernel7(t), pairs, pick)
		})
	}
	t.Logf("TestMigration took %.1fs", time.Since(start).Seconds())
}

// migrationMatrix runs TestMigration's scenarios (those pick names, else
// the basic one or, with GOVIRTIOFSD_E2E_FULL=1, all) for each pair, on
// QEMU q with guest kernel k.
func migrationMatrix(t *testing.T, q qemuVersion, k guestKernel, pairs []migPair, pick []string) {
	for _, p := range pairs {
		t.Run(p.name, func(t *testing.T) {
			for _, sc := range migScenarios {
				switch {
				case pick != nil && !slices.Contains(pick, sc.name):
					continue
				case pick == nil && sc.full && !fullE2E():
					continue
				}
				t.Run(sc.name, func(t *testing.T) {
					if sc.oursOnly && p.hasRust() {
						t.Skip("the Rust virtiofsd serves one request queue")
					}
					st := time.Now()
					m := newMigEnv(t, p, k)
					m.cfg.QEMU = q
					sc.run(m)
					if q == qemu11 && sc.name == "basic" {
						summarizeMigration(t, m)
					}
					t.Logf("%s/%s took %.1fs", p.name, sc.name, time.Since(st).Seconds())
				})
			}
		})
	}
}

// ---------------------------------------------------------------------------

// migEnv is one scenario: a share, the QEMU configuration every hop uses,
// and the hops (QEMU + daemon) the guest ran on, in order.
type migEnv struct {
	t       *testing.T
	pair    migPair
	kernel  guestKernel
	dir     string // artifacts
	shared  string
	sockDir string
	cfg     vmConfig
	hops    []*migHop
	cur     *migHop // where the guest runs
	con     *guestConsole
	migs    []migRecord
}

// migRecord is one migration: its hops, when the host sent migrate and
// when it saw the migration end.
type migRecord struct {
	src, dst   *migHop
	start, end time.Time
	info       migrationInfo
}

// migHop is one QEMU and its daemon: "src", then "dst1", "dst2", ...
type migHop struct {
	name     string
	kind     daemonKind
	args     []string // the daemon's extra arguments
	sock     string
	incoming string // -incoming unix: path ("" for src)
	d        *daemon
	v        *vm
}

func newMigEnv(t *testing.T, p migPair, k guestKernel) *migEnv {
	m := &migEnv{t: t, pair: p, kernel: k, dir: artifactDir(t), shared: t.TempDir()}
	if err := os.WriteFile(filepath.Join(m.shared, "hello"), []byte(helloContent), 0o644); err != nil {
		t.Fatal(err)
	}
	sockDir, err := os.MkdirTemp("", "e2e-mig-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	m.sockDir = sockDir
	m.cfg = vmConfig{
		Kernel: k, QEMU: qemu10, Script: "migrate", Timeout: 8 * time.Minute,
		Append: []string{"e2e.asktimeout=300"},
		// QEMU's side of the vhost-user conversation (the Rust daemon
		// does not log it) and the migration's device phases.
		Trace: []string{"vhost_user_read", "vhost_user_write", "vhost_dev_start", "vhost_dev_stop",
			"vmstate_save", "migration_completion_vm_stop", "qemu_loadvm_state_section_startfull"},
	}
	return m
}

// daemonArgs are a kind's standard arguments in these scenarios.
func migDaemonArgs(kind daemonKind) []string {
	switch kind {
	case rustDaemon, rust114Daemon:
		// startDaemon adds --cache never.
		return []string{"--log-level", "debug"}
	case ourDaemon:
		// startDaemon adds --log-level debug (the node-id check reads it).
		return []string{"--cache", "never"}
	}
	return nil
}

// startHop starts the next hop's daemon (its kind alternates: the pair's
// src for src, dst1's dst, dst2's src, ...) with extra arguments, and its
// QEMU: src boots the guest (booted again, with a fresh daemon, if the
// guest kernel died booting: see diedBooting), the others wait with
// -incoming.
func (m *migEnv) startHop(extra ...string) *migHop {
	t := m.t
	t.Helper()
	i := len(m.hops)
	h := &migHop{name: "src", kind: m.pair.src}
	if i > 0 {
		h.name = "dst" + strconv.Itoa(i)
		if i%2 == 1 {
			h.kind = m.pair.dst
		}
		h.incoming = filepath.Join(m.sockDir, "mig-"+h.name+".sock")
	}
	h.args = append(migDaemonArgs(h.kind), extra...)
	h.sock = filepath.Join(m.sockDir, "vhost-"+h.name+".sock")
	cfg := m.cfg
	cfg.Sock, cfg.Name, cfg.Incoming = h.sock, h.name, h.incoming
	daemonLog := filepath.Join(m.dir, "daemon-"+h.name+".log")
	h.d = startDaemon(t, h.kind, h.sock, m.shared, daemonLog, h.args...)
	h.v = startVM(t, m.dir, cfg)
	if i == 0 && h.v.diedBooting(h.v.timeout) {
		t.Logf("booting the guest again with a fresh daemon")
		h.v.Kill()
		h.d.Kill()
		for _, p := range []string{h.v.consolePath, daemonLog} {
			if err := os.Rename(p, strings.TrimSuffix(p, ".log")+"-crashed.log"); err != nil {
				t.Logf("keep the crashed boot's log: %v", err)
			}
		}
		if err := os.Remove(h.sock); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		h.d = startDaemon(t, h.kind, h.sock, m.shared, daemonLog, h.args...)
		h.v = startVM(t, m.dir, cfg)
		h.v.diedBooting(h.v.timeout)
	}
	m.hops = append(m.hops, h)
	if i == 0 {
		m.cur = h
		m.con = newGuestConsole(t, h.v)
	}
	return h
}

// waitAsk waits for the guest's E2E-ASK migrate-N.
func (m *migEnv) waitAsk(n int) {
	m.t.Helper()
	m.con.waitConsole(regexp.MustCompile(`E2E-ASK migrate-`+strconv.Itoa(n)+`\b`), 1, 4*time.Minute)
}

// migrateTo migrates the guest from the current hop to dst (a hop started
// with -incoming) and logs the outcome; a completed migration moves the
// guest's console to dst.
func (m *migEnv) migrateTo(dst *migHop, o migrateOptions) migrationInfo {
	m.t.Helper()
	start := time.Now()
	info := migrate(m.cur.v, dst.v, dst.incoming, o)
	m.logMigration(dst, start, info)
	if info.Status == "completed" {
		m.moveTo(dst)
	}
	return info
}

// logMigration logs a migration from the current hop to dst and keeps its
// record (logVhostUser).
func (m *migEnv) logMigration(dst *migHop, start time.Time, info migrationInfo) {
	if info.Timeline == "" {
		_, _ = dst.v.qmpTry("query-status", nil) // collect its events, if it still runs
		info.Timeline = migrationTimeline(start.Add(-time.Second), m.cur.v, dst.v)
	}
	m.t.Logf("migration %s (%s) -> %s (%s): %s", m.cur.name, m.cur.kind, dst.name, dst.kind, info)
	if info.Timeline != "" {
		m.t.Logf("  QMP events: %s", info.Timeline)
	}
	m.migs = append(m.migs, migRecord{src: m.cur, dst: dst, start: start, end: time.Now(), info: info})
}

func (m *migEnv) moveTo(dst *migHop) {
	m.con.moveTo(dst.v)
	m.cur = dst
}

// requireStatus fails the test unless the migration ended as want.
func (m *migEnv) requireStatus(info migrationInfo, want string) {
	m.t.Helper()
	if info.Status != want {
		m.t.Fatalf("migration ended %q, want %q: %s\n%s", info.Status, want, info, m.daemonTails())
	}
}

// daemonTails returns the last lines of every hop's daemon log, without
// the per-request debug lines.
func (m *migEnv) daemonTails() string {
	var b strings.Builder
	for _, h := range m.hops {
		data, err := os.ReadFile(h.d.LogPath)
		if err != nil {
			fmt.Fprintf(&b, "%s daemon: %v\n", h.name, err)
			continue
		}
		var keep []string
		for _, l := range strings.Split(strings.TrimRight(string(data), "\n"), "\n") {
			if !strings.Contains(l, `msg="fuse request"`) && !strings.Contains(l, "virtiofsd::server]") && !strings.Contains(l, "QUEUE_EVENT") {
				keep = append(keep, l)
			}
		}
		fmt.Fprintf(&b, "%s daemon (%s) %s:\n%s\n", h.name, h.kind, h.d.LogPath, lastLines(keep, 12))
	}
	return b.String()
}

// quitSource ends a migrated-away hop's QEMU (postmigrate) with quit and
// requires it and its daemon to exit 0.
func (m *migEnv) quitSource(h *migHop) {
	m.t.Helper()
	if st := h.v.runState(); st != "postmigrate" {
		m.t.Errorf("%s: QEMU run state %q after the migration, want postmigrate", h.name, st)
	}
	h.v.qmpQuit()
	h.v.waitExit()
	m.daemonExit(h, true)
}

// daemonExit waits for a hop's daemon to exit after its QEMU did; with
// require0 its status must be 0.
func (m *migEnv) daemonExit(h *migHop, require0 bool) {
	t := m.t
	t.Helper()
	if !h.d.Wait(daemonExitTimeout) {
		t.Fatalf("%s daemon (%s) still running %v after its QEMU exited\n%s", h.name, h.kind, daemonExitTimeout, tail(h.d.LogPath, 20))
	}
	t.Logf("%s daemon (%s) exited with status %d", h.name, h.kind, h.d.Status().Code)
	if require0 && h.d.Status().Code != 0 {
		t.Errorf("%s daemon (%s) exit status %d (%v), want 0\n%s", h.name, h.kind, h.d.Status().Code, h.d.Err(), tail(h.d.LogPath, 20))
	}
}

// failedDestination: after a failed or cancelled migration the destination
// QEMU exits by itself (its load failed), and then its daemon.
func (m *migEnv) failedDestination(h *migHop) {
	m.t.Helper()
	if !h.v.Wait(30 * time.Second) {
		m.t.Errorf("%s: QEMU still running 30s after the migration failed", h.name)
		h.v.Kill()
	}
	m.t.Logf("%s: QEMU exited with status %d after the failed migration (%s)", h.name, h.v.Status().Code,
		strings.TrimPrefix(lastLines(grepLines(h.v.consoleLines(), "qemu-system"), 3), "  | "))
	m.daemonExit(h, false)
}

// requireRunning fails the test unless the hop's QEMU runs the guest.
func (m *migEnv) requireRunning(h *migHop) {
	m.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := h.v.runState()
		if st == "running" {
			return
		}
		if time.Now().After(deadline) {
			m.t.Fatalf("%s: QEMU run state %q after the failed migration, want running (the source resumes)", h.name, st)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// finish waits for the guest to power off on the current hop: its QEMU
// must exit 0 and its daemon 0 after it.
func (m *migEnv) finish() {
	m.t.Helper()
	m.cur.v.waitExit()
	m.daemonExit(m.cur, true)
}

// ---------------------------------------------------------------------------
// The guest's report (migrate.sh, migrate-mount.sh)

var (
	reMigCheck    = regexp.MustCompile(`E2E-MIG-CHECK (\S+) (ok|fail)\b ?(.*)`)
	reMigFio      = regexp.MustCompile(`E2E-MIG-FIO pass=(\d+) rc=(\d+) phase=(\d+) endphase=(\d+)`)
	reMigEnd      = regexp.MustCompile(`E2E-MIG-END (.*)`)
	reMigUnlinked = regexp.MustCompile(`E2E-MIG-UNLINKED rc=(\d+) out=(\S*)`)
	reKV          = regexp.MustCompile(`(\w+)=(\S*)`)
)

type migReport struct {
	checks   map[string]string // name -> "ok" or "fail DETAIL"
	order    []string
	fio      []migFioPass
	ends     []map[string]string // E2E-MIG-END key=values, per boot
	unlinked *migUnlinked
}

// migUnlinked is E2E-MIG-UNLINKED: reading the unlinked file's fd.
type migUnlinked struct {
	rc  int
	out string
}

type migFioPass struct{ pass, rc, phase, endPhase int }

func parseMigReport(lines []string) migReport {
	r := migReport{checks: map[string]string{}}
	for _, l := range lines {
		if x := reMigCheck.FindStringSubmatch(l); x != nil {
			name := x[1]
			for n := 2; r.checks[name] != ""; n++ {
				name = x[1] + "#" + strconv.Itoa(n)
			}
			r.checks[name] = strings.TrimSpace(x[2] + " " + x[3])
			r.order = append(r.order, name)
		} else if x := reMigFio.FindStringSubmatch(l); x != nil {
			var p migFioPass
			p.pass, _ = strconv.Atoi(x[1])
			p.rc, _ = strconv.Atoi(x[2])
			p.phase, _ = strconv.Atoi(x[3])
			p.endPhase, _ = strconv.Atoi(x[4])
			r.fio = append(r.fio, p)
		} else if x := reMigEnd.FindStringSubmatch(l); x != nil {
			kv := map[string]string{}
			for _, y := range reKV.FindAllStringSubmatch(x[1], -1) {
				kv[y[1]] = y[2]
			}
			r.ends = append(r.ends, kv)
		} else if x := reMigUnlinked.FindStringSubmatch(l); x != nil {
			rc, _ := strconv.Atoi(x[1])
			r.unlinked = &migUnlinked{rc, x[2]}
		}
	}
	return r
}

// judgeGuest requires the guest's report to be clean: every check ok,
// every fio pass verified, and `ends` E2E-MIG-END lines, each failed=0.
func (m *migEnv) judgeGuest(ends int) migReport {
	t := m.t
	t.Helper()
	lines := m.con.lines()
	r := parseMigReport(lines)
	g := parseConsole(lines)
	for _, s := range g.Steps {
		if s.RC != 0 {
			t.Logf("  boot %d step %-12s rc=%d %s", s.Boot, s.Name, s.RC, strings.Join(s.Output, " | "))
		}
	}
	for _, name := range r.order {
		if v := r.checks[name]; !strings.HasPrefix(v, "ok") {
			t.Errorf("guest check %s: %s", name, v)
		}
	}
	across := 0
	for _, p := range r.fio {
		if p.rc != 0 {
			t.Errorf("guest fio pass %d (begun after %d answers, ended after %d) failed: rc=%d", p.pass, p.phase, p.endPhase, p.rc)
		}
		if p.endPhase > p.phase {
			across++
		}
	}
	if len(r.ends) != ends {
		t.Fatalf("guest printed %d E2E-MIG-END lines, want %d\n%s", len(r.ends), ends, lastLines(lines, 30))
	}
	for _, e := range r.ends {
		if e["failed"] != "0" {
			t.Errorf("guest: E2E-MIG-END failed=%s", e["failed"])
		}
	}
	if len(r.fio) > 0 {
		t.Logf("guest: %d checks, %d fio passes (write + crc32c verify; %d running when an answer came), %v",
			len(r.order), len(r.fio), across, r.ends)
	} else {
		t.Logf("guest: %d checks, %v", len(r.order), r.ends)
	}
	return r
}

// checkShare checks the files migrate.sh left: read.txt intact, the
// append file (name: append.txt or where the host renamed it) holding
// exactly "line 1".."line N" with N the guest's count.
func (m *migEnv) checkShare(r migReport, readName, appendName string) {
	t := m.t
	t.Helper()
	want := seqLines(1, 20000)
	got, err := os.ReadFile(filepath.Join(m.shared, "mig", readName))
	if err != nil {
		t.Errorf("host: %v", err)
	} else if string(got) != want {
		t.Errorf("host: mig/%s changed (%d bytes, want %d)", readName, len(got), len(want))
	}
	n, err := strconv.Atoi(r.ends[0]["appended"])
	if err != nil {
		t.Fatalf("guest: E2E-MIG-END without appended=: %v", r.ends[0])
	}
	f, err := os.Open(filepath.Join(m.shared, "mig", appendName))
	if err != nil {
		t.Fatalf("host: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	i, bad := 0, 0
	for sc.Scan() {
		i++
		if sc.Text() != "line "+strconv.Itoa(i) && bad < 5 {
			bad++
			t.Errorf("host: mig/%s line %d is %q", appendName, i, sc.Text())
		}
	}
	if i != n {
		t.Errorf("host: mig/%s has %d lines, the guest appended %d", appendName, i, n)
	}
	if bad == 0 && i == n {
		t.Logf("host: mig/%s holds line 1..%d in order; mig/%s intact", appendName, n, readName)
	}
}

func seqLines(from, to int) string {
	var b strings.Builder
	for i := from; i <= to; i++ {
		b.WriteString(strconv.Itoa(i))
		b.WriteByte('\n')
	}
	return b.String()
}

func grepLines(lines []string, sub string) []string {
	var out []string
	for _, l := range lines {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return out
}

// checkNodeIDs: for every completed hop with one of our daemons, the
// node ids the destination served before any new INIT (a remount or a
// reboot starts a new session) must be ones the source served or handed
// out, or the destination itself handed out first: the guest kernel keeps
// the source's node ids for its open files and cached inodes.
func (m *migEnv) checkNodeIDs() {
	t := m.t
	t.Helper()
	for i := 1; i < len(m.hops); i++ {
		src, dst := m.hops[i-1], m.hops[i]
		if !m.reached(dst) || (src.kind != ourDaemon && dst.kind != ourDaemon) {
			continue
		}
		foreign, openIDs := foreignNodeIDs(src.d.fuseRequests(t), dst.d.fuseRequests(t))
		if src.kind != ourDaemon || dst.kind != ourDaemon {
			// The Rust daemon does not log the ids its replies hand
			// out, so only the files' ids can be compared: ours, as
			// the destination, must READ and WRITE only on ids the
			// Rust source was sent or ours handed out; a Rust
			// destination must READ or WRITE on some id ours served
			// (the guest's files held open across the migration).
			foreign = nil
			known := map[string]bool{}
			for _, r := range src.d.fuseRequests(t) {
				known[r.NodeID] = true
			}
			migrated := 0
			for _, id := range openIDs {
				if known[id] {
					migrated++
				}
			}
			if dst.kind == ourDaemon {
				for _, r := range dst.d.fuseRequests(t) {
					if r.Entry != "" {
						known[r.Entry] = true
					}
				}
				for _, id := range openIDs {
					if !known[id] {
						foreign = append(foreign, "READ/WRITE:"+id)
					}
				}
			} else if migrated == 0 {
				t.Errorf("%s: none of its READs/WRITEs %v is on a node id %s served", dst.name, openIDs, src.name)
			}
		}
		if len(foreign) > 0 {
			t.Errorf("%s served node ids %s never served: %v", dst.name, src.name, foreign[:min(len(foreign), 20)])
		}
		if len(openIDs) == 0 {
			t.Errorf("%s logged no READ or WRITE before a new INIT: the open files were not used there", dst.name)
		}
		t.Logf("%s: node ids of its READs/WRITEs after the migration from %s: %v; requests on node ids %s never served: %d",
			dst.name, src.name, openIDs, src.name, len(foreign))
	}
}

// foreignNodeIDs returns the destination's requests (OPCODE:NODEID) before
// its first INIT whose node id neither the source served or handed out
// (entry=, the id of a LOOKUP's or CREATE's reply) nor the destination
// handed out before (0 and 1, the root, always count), and the node ids of
// its READs and WRITEs there.
func foreignNodeIDs(src, dst []fuseRequest) (foreign, readWrite []string) {
	known := map[string]bool{"0": true, "1": true}
	for _, r := range src {
		known[r.NodeID] = true
		if r.Entry != "" {
			known[r.Entry] = true
		}
	}
	rw := map[string]bool{}
	for _, r := range dst {
		if r.Opcode == "INIT" {
			break
		}
		if !known[r.NodeID] {
			foreign = append(foreign, r.Opcode+":"+r.NodeID)
		}
		if r.Entry != "" {
			known[r.Entry] = true // a new file made on the destination
		}
		if r.Opcode == "READ" || r.Opcode == "WRITE" {
			rw[r.NodeID] = true
		}
	}
	return foreign, slices.Sorted(maps.Keys(rw))
}

// reached reports whether the guest ran on h (a migration to it completed).
func (m *migEnv) reached(h *migHop) bool {
	m.con.mu.Lock()
	defer m.con.mu.Unlock()
	return slices.Contains(m.con.vms, h.v)
}

// logVhostUser logs, per migration, the vhost-user requests each QEMU sent
// its daemon (from QEMU's trace: vhostTraceNames) while it ran, and where
// the device's share of the downtime went; it writes every hop's whole
// sequence to vhost-user-HOP.txt. For our daemon it also compares with the
// daemon's own log (msg="vhost-user message").
func (m *migEnv) logVhostUser() {
	t := m.t
	t.Helper()
	for _, r := range m.migs {
		if r.src.v.tracePath == "" {
			return
		}
		srcEv, dstEv := readQEMUTrace(t, r.src.v.tracePath), readQEMUTrace(t, r.dst.v.tracePath)
		end := r.end.Add(500 * time.Millisecond)
		t.Logf("  %s -> %s (%s): QEMU %s sent %s", r.src.name, r.dst.name, r.info.Status, r.src.name,
			compactSequence(vhostTraceNames(srcEv, r.start, end)))
		t.Logf("  %s -> %s (%s): QEMU %s sent (from its start) %s", r.src.name, r.dst.name, r.info.Status, r.dst.name,
			compactSequence(vhostTraceNames(dstEv, time.Time{}, end)))
		// Where the downtime went: the device's stop and state save, the
		// last RAM pass, and the destination's load of the device.
		stop := traceSpan(srcEv, r.start, "vhost_dev_stop", "", "migration_completion_vm_stop", "")
		ram := traceSpan(srcEv, r.start, "migration_completion_vm_stop", "", "vmstate_save", "")
		save := traceSpan(srcEv, r.start, "vmstate_save", "vhost-user-fs", "vhost_user_read", "req:43")
		load := traceSpan(dstEv, time.Time{}, "qemu_loadvm_state_section_startfull", "vhost-user-fs", "vhost_dev_start", "")
		if stop > 0 || save > 0 {
			t.Logf("  %s: device stop (ENABLE 0, GET_VRING_BASE) %d ms; last RAM pass %d ms; device state save (SET_DEVICE_STATE_FD to CHECK's reply) %d ms; %s: device state load to device start %d ms",
				r.src.name, stop.Milliseconds(), ram.Milliseconds(), save.Milliseconds(), r.dst.name, load.Milliseconds())
		}
	}
	for _, h := range m.hops {
		if h.v.tracePath == "" {
			continue
		}
		evs := readQEMUTrace(t, h.v.tracePath)
		var lines []string
		for _, e := range evs {
			if e.Name == "vhost_user_read" || e.Name == "vmstate_save" && !strings.Contains(e.Args, "vhost-user-fs") ||
				e.Name == "qemu_loadvm_state_section_startfull" && !strings.Contains(e.Args, "vhost-user-fs") {
				continue
			}
			names := vhostTraceNames([]qemuTraceEvent{e}, time.Time{}, time.Time{})
			if len(names) == 1 {
				lines = append(lines, fmt.Sprintf("%s %s", e.At.Format("15:04:05.000000"), names[0]))
			}
		}
		path := filepath.Join(m.dir, "vhost-user-"+h.name+".txt")
		if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if h.kind == ourDaemon {
			var names []string
			for _, x := range h.d.vhostMessages(t, 0, -1) {
				names = append(names, x.Request)
			}
			t.Logf("  %s: govirtiofsd logged %d vhost-user messages: %s", h.name, len(names), compactSequence(names))
		}
	}
}

// ---------------------------------------------------------------------------
// Scenarios

// migrateOnce: boot on src, migrate to dst1 while the guest works, answer,
// quit src; the guest checks and powers off on dst1 (after a reboot there
// with e2e.migreboot=1). With cfg.Packed the guest must have negotiated
// packed rings on src, and dst1's QEMU must run the device on them.
func (m *migEnv) migrateOnce(srcArgs, dstArgs []string, o migrateOptions) migReport {
	m.startHop(srcArgs...)
	m.waitAsk(1)
	if m.cfg.Packed {
		requirePacked(m.t, m.con.lines(), 1)
	}
	src := m.cur
	dst := m.startHop(dstArgs...)
	info := m.migrateTo(dst, o)
	m.requireStatus(info, "completed")
	if m.cfg.Packed {
		if m.cfg.QEMU == qemu11 {
			// QEMU 11.1.3 aborts on x-query-virtio-status for a
			// vhost-user-fs device (qapi-visit-core.c:52
			// visit_start_struct assertion, seen here with and
			// without a migration): ask the destination daemon.
			requireDaemonPacked(m.t, dst)
		} else {
			requireQEMUPacked(m.t, dst.v)
		}
	}
	m.con.answer("completed")
	m.quitSource(src)
	m.finish()
	m.logVhostUser()
	return parseMigReport(m.con.lines())
}

// requireDaemonPacked fails the test unless our daemon of hop h started
// rings and every one on a packed layout (its "ring started" lines).
func requireDaemonPacked(t *testing.T, h *migHop) {
	t.Helper()
	if h.kind != ourDaemon {
		t.Fatalf("%s: the ring layout is read from our daemon's log; %s logs none", h.name, h.kind)
	}
	data, err := os.ReadFile(h.d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		kv := parseLogfmt(line)
		if kv["msg"] != "ring started" {
			continue
		}
		n++
		if kv["packed"] != "true" {
			t.Fatalf("%s: a ring started on a split layout: %s", h.name, line)
		}
	}
	if n == 0 {
		t.Fatalf("%s: its daemon logged no \"ring started\"", h.name)
	}
	t.Logf("%s: its daemon started %d ring(s), all packed", h.name, n)
}

func scenarioMigrateBasic(m *migEnv) {
	m.migrateOnce(nil, nil, migrateOptions{})
	r := m.judgeGuest(1)
	m.checkShare(r, "read.txt", "append.txt")
	m.checkNodeIDs()
}

func scenarioMigrate2Queues(m *migEnv) {
	m.cfg.DeviceOpts = []string{"num-request-queues=2"}
	scenarioMigrateBasic(m)
}

// scenarioMigrateReboot: after the migration and its checks the guest
// reboots on the destination, mounts again (a new FUSE session on the
// destination daemon) and checks the files.
func scenarioMigrateReboot(m *migEnv) {
	m.cfg.AllowReboot = true
	m.cfg.Append = append(m.cfg.Append, "e2e.migreboot=1")
	m.migrateOnce(nil, nil, migrateOptions{})
	r := m.judgeGuest(2)
	if r.ends[1]["rebooted"] != "1" {
		m.t.Errorf("guest: second E2E-MIG-END %v, want rebooted=1", r.ends[1])
	}
	if g := parseConsole(m.con.lines()); g.Boots != 2 {
		m.t.Errorf("guest booted %d times, want 2 (once on src, once on dst1)", g.Boots)
	}
	m.checkNodeIDs()
}

// scenarioMigrateBackAndForth: three migrations, A→B→A'→B', each to a
// fresh QEMU with a fresh daemon.
func scenarioMigrateBackAndForth(m *migEnv) {
	const n = 3
	m.cfg.Append = append(m.cfg.Append, "e2e.migcount="+strconv.Itoa(n))
	m.startHop()
	for i := 1; i <= n; i++ {
		m.waitAsk(i)
		src := m.cur
		dst := m.startHop()
		info := m.migrateTo(dst, migrateOptions{})
		m.requireStatus(info, "completed")
		m.con.answer("completed")
		m.quitSource(src)
	}
	m.finish()
	m.logVhostUser()
	r := m.judgeGuest(1)
	m.checkShare(r, "read.txt", "append.txt")
	m.checkNodeIDs()
}

// scenarioMigrateRename: the host renames both open files while the
// migration runs (the source daemon with --migration-confirm-paths); the
// fds must keep working, the appends landing in the renamed file.
func scenarioMigrateRename(m *migEnv) {
	t := m.t
	src, dst, start := m.startSlowMigration(16<<20, "--migration-confirm-paths")
	for _, n := range []string{"read", "append"} {
		from, to := filepath.Join(m.shared, "mig", n+".txt"), filepath.Join(m.shared, "mig", n+"-renamed.txt")
		if err := os.Rename(from, to); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("host: renamed mig/read.txt and mig/append.txt to *-renamed.txt while the migration ran (%s)", src.v.queryMigrate().Status)
	src.v.setMigrationSpeed(migrateOptions{})
	info := src.v.waitMigration(0)
	m.logMigration(dst, start, info)
	m.requireStatus(info, "completed")
	m.moveTo(dst)
	m.con.answer("completed append=append-renamed.txt read=read-renamed.txt")
	m.quitSource(src)
	m.finish()
	m.logVhostUser()
	r := m.judgeGuest(1)
	m.checkShare(r, "read-renamed.txt", "append-renamed.txt")
	m.checkNodeIDs()
}

// startSlowMigration starts the source hop with srcFlags, waits for the
// guest's first ask, starts the destination hop and a migration limited to
// bandwidth bytes a second (slow, so the scenario acts while RAM is being
// copied), and returns once it is active, with when it started.
func (m *migEnv) startSlowMigration(bandwidth int64, srcFlags ...string) (src, dst *migHop, start time.Time) {
	t := m.t
	t.Helper()
	m.startHop(srcFlags...)
	m.waitAsk(1)
	src = m.cur
	dst = m.startHop()
	prepareMigration(src.v, dst.v, migrateOptions{MaxBandwidth: bandwidth})
	start = time.Now()
	if err := src.v.startMigration(dst.incoming); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	waitMigrationActive(t, src.v)
	return src, dst, start
}

// waitMigrationActive waits until query-migrate says active.
func waitMigrationActive(t *testing.T, v *vm) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		info := v.queryMigrate()
		switch info.Status {
		case "active":
			return
		case "completed", "failed", "cancelled":
			t.Fatalf("migration ended before the host could act: %s", info)
		}
		if time.Now().After(deadline) {
			t.Fatalf("migration not active after 30s: %s", info)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// scenarioMigrateUnlinked: the guest holds mig/unlinked.txt open (fd 5);
// the host unlinks it before migrating; the destination daemon runs with
// --migration-on-error onError.
//   - abort: the migration must fail, the source resume, and the guest go
//     on there with every fd working (fd 5 too: the source daemon still
//     holds the file).
//   - guest-error: the migration completes; reading fd 5 on the
//     destination fails, every other fd works. With our daemon on the
//     destination the error must be ESTALE; the Rust virtiofsd 1.13 marks
//     the inode invalid and answers EIO (seen here), which is accepted for
//     it.
func scenarioMigrateUnlinked(m *migEnv, onError string) {
	t := m.t
	m.cfg.Append = append(m.cfg.Append, "e2e.migunlinked=1")
	m.startHop()
	m.waitAsk(1)
	src := m.cur
	if err := os.Remove(filepath.Join(m.shared, "mig", "unlinked.txt")); err != nil {
		t.Fatal(err)
	}
	dst := m.startHop("--migration-on-error", onError)
	info := m.migrateTo(dst, migrateOptions{})
	switch onError {
	case "abort":
		m.requireStatus(info, "failed")
		m.requireRunning(src)
		m.failedDestination(dst)
		m.con.answer("failed")
		m.finish()
	default:
		m.requireStatus(info, "completed")
		m.con.answer("completed")
		m.quitSource(src)
		m.finish()
	}
	m.logVhostUser()
	r := m.judgeGuest(1)
	m.checkShare(r, "read.txt", "append.txt")
	if r.unlinked == nil {
		t.Fatalf("guest did not report reading the unlinked file (E2E-MIG-UNLINKED)")
	}
	t.Logf("guest: reading the unlinked file's fd after the migration: rc=%d %s", r.unlinked.rc, r.unlinked.out)
	switch {
	case onError == "abort" && (r.unlinked.rc != 0 || r.unlinked.out != "content-ok"):
		t.Errorf("unlinked file on the source after the failed migration: rc=%d %s, want its content", r.unlinked.rc, r.unlinked.out)
	case onError == "guest-error" && r.unlinked.rc == 0:
		t.Errorf("unlinked file on the destination (guest-error): read succeeded (%s), want an error", r.unlinked.out)
	case onError == "guest-error" && dst.kind == ourDaemon && !strings.Contains(r.unlinked.out, "Stale_file_handle"):
		t.Errorf("unlinked file on the destination (guest-error): %s, want ESTALE (Stale file handle)", r.unlinked.out)
	}
	m.checkNodeIDs()
}

// nextKind is the daemon kind of the next hop startHop starts.
func (m *migEnv) nextKind() daemonKind {
	if i := len(m.hops); i%2 == 1 {
		return m.pair.dst
	}
	return m.pair.src
}

// fileHandleArgs puts a daemon in file-handles migration mode: a Rust
// daemon also needs CAP_DAC_READ_SEARCH granted (it ignores the mode on a
// destination); ours keeps it in that mode.
func fileHandleArgs(k daemonKind) []string {
	if isRust(k) {
		return []string{"--migration-mode", "file-handles", "--modcaps=+dac_read_search"}
	}
	return []string{"--migration-mode", "file-handles"}
}

// scenarioMigrateFileHandles: as unlinked-abort, the guest holds
// mig/unlinked.txt open and the host unlinks it before migrating, but
// both daemons run in file-handles mode: the migration completes and the
// guest reads the unlinked file on the destination (a find-paths
// migration cannot: it has no path).
func scenarioMigrateFileHandles(m *migEnv) {
	t := m.t
	m.cfg.Append = append(m.cfg.Append, "e2e.migunlinked=1")
	m.startHop(fileHandleArgs(m.nextKind())...)
	m.waitAsk(1)
	src := m.cur
	if err := os.Remove(filepath.Join(m.shared, "mig", "unlinked.txt")); err != nil {
		t.Fatal(err)
	}
	dst := m.startHop(fileHandleArgs(m.nextKind())...)
	info := m.migrateTo(dst, migrateOptions{})
	m.requireStatus(info, "completed")
	m.con.answer("completed")
	m.quitSource(src)
	m.finish()
	m.logVhostUser()
	r := m.judgeGuest(1)
	m.checkShare(r, "read.txt", "append.txt")
	if r.unlinked == nil {
		t.Fatalf("guest did not report reading the unlinked file (E2E-MIG-UNLINKED)")
	}
	if r.unlinked.rc != 0 || r.unlinked.out != "content-ok" {
		t.Errorf("unlinked file on the destination (file-handles): rc=%d %s, want its content", r.unlinked.rc, r.unlinked.out)
	}
	m.checkNodeIDs()
}

// scenarioMigrateVerifyHandles: the source runs with
// --migration-verify-handles; while RAM is copied the host replaces
// mig/read.txt, which the guest holds open, by another file (same content,
// another inode). The destination must notice that the path now leads to
// another object, not open it as the guest's file: with
// --migration-on-error abort the migration fails, the source resumes and
// the guest goes on reading its file there.
func scenarioMigrateVerifyHandles(m *migEnv) {
	t := m.t
	src, dst, start := m.startSlowMigration(16<<20, "--migration-verify-handles")
	path := filepath.Join(m.shared, "mig", "read.txt")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+".new", data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
	t.Logf("host: replaced mig/read.txt by a copy while the migration ran (%s)", src.v.queryMigrate().Status)
	src.v.setMigrationSpeed(migrateOptions{})
	info := src.v.waitMigration(0)
	m.logMigration(dst, start, info)
	m.requireStatus(info, "failed")
	m.requireRunning(src)
	m.failedDestination(dst)
	m.con.answer("failed")
	m.finish()
	m.logVhostUser()
	r := m.judgeGuest(1)
	m.checkShare(r, "read.txt", "append.txt")
}

// scenarioMigrateCancel: a slow migration (max-bandwidth 4 MiB/s) is
// cancelled with migrate_cancel once active; the source resumes and the
// guest goes on there; the destination QEMU and daemon exit.
func scenarioMigrateCancel(m *migEnv) {
	t := m.t
	src, dst, start := m.startSlowMigration(4 << 20)
	time.Sleep(3 * time.Second)
	src.v.cancelMigration()
	info := src.v.waitMigration(0)
	m.logMigration(dst, start, info)
	if info.Status == "failed" && strings.Contains(info.ErrorDesc, "Channel error") {
		// migrate_cancel shuts the channel down; when the migration
		// thread is inside a RAM write then, QEMU 10 reports the
		// cancel as a failure ("failed to save SaveStateEntry ...
		// (ram): -5", "Channel error: Input/output error"). What this
		// scenario is about comes next: the source runs on, logging
		// off, the guest goes on.
		t.Logf("QEMU reported the cancel as a failed migration: %s", info.ErrorDesc)
	} else {
		m.requireStatus(info, "cancelled")
	}
	m.requireRunning(src)
	m.failedDestination(dst)
	m.con.answer("cancelled")
	m.finish()
	m.logVhostUser()
	r := m.judgeGuest(1)
	m.checkShare(r, "read.txt", "append.txt")
}

// scenarioMigrateUnmounted: migrate before the guest's first mount
// (premount) or after it unmounted (postumount); the guest then mounts on
// the destination and uses the share (migrate-mount.sh).
func scenarioMigrateUnmounted(m *migEnv, when string) {
	m.cfg.Script = "migrate-mount"
	m.cfg.Append = append(m.cfg.Append, "e2e.migwhen="+when)
	if when == "premount" {
		m.cfg.Append = append(m.cfg.Append, "e2e.mount=0")
	}
	m.migrateOnce(nil, nil, migrateOptions{})
	m.judgeGuest(1)
	if when == "postumount" {
		got, err := os.ReadFile(filepath.Join(m.shared, "post.txt"))
		if err != nil || string(got) != seqLines(1, 5000) {
			m.t.Errorf("host: post.txt: %v (%d bytes)", err, len(got))
		}
	}
}
