package integration

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// rust114 is the Rust virtiofsd 1.14 (make test-deps), "" without it.
func rust114() string {
	p, err := launch.Existing("../../.cache/peers/bin/virtiofsd-rust-1.14")
	if err != nil {
		return ""
	}
	return p
}

// copyRange sends COPY_FILE_RANGE_64 (or COPY_FILE_RANGE) of n bytes between
// two handles and returns the count the reply carries.
func (c *fsc) copyRange(op uint32, inNode, inFh, outNode, outFh, n uint64) (uint64, error) {
	in := le64(le64(le64(le64(le64(le64(le64(nil, inFh), 0), outNode), outFh), 0), n), 0)
	b, err := c.Call(op, inNode, in, nil, 8)
	if err != nil {
		return 0, err
	}
	if len(b) != 8 {
		return 0, errors.New("copy reply of the wrong size")
	}
	if op == vmm.OpCopyFileRange {
		return uint64(le.Uint32(b)), nil
	}
	return le.Uint64(b), nil
}

// TestMigration745: a guest session at 7.45 with ALLOW_IDMAP (Linux 7.2)
// moves to this daemon with both, its handles serving and
// COPY_FILE_RANGE_64 served; to the Rust virtiofsd 1.14 (7.38) it keeps
// working, COPY_FILE_RANGE_64 answered ENOSYS, and COPY_FILE_RANGE, the
// guest's fallback, served.
func TestMigration745(t *testing.T) {
	src := startDaemon(t)
	sdev := src.connect(migOpts())
	c := newFS(t, sdev, 1)
	c.mount745()
	data := pattern(7, 10000)
	a, afh := c.create(vmm.RootID, "a", syscall.O_RDWR)
	c.write(a, afh, 0, data)
	b, bfh := c.create(vmm.RootID, "b", syscall.O_RDWR)
	if n, err := c.copyRange(vmm.OpCopyFileRange64, a, afh, b, bfh, 1<<40); err != nil || n != uint64(len(data)) {
		t.Fatalf("COPY_FILE_RANGE_64 on the source: %d %v", n, err)
	}
	state := saveState(t, sdev)
	if src.logCount("a Rust virtiofsd destination (7.38) answers COPY_FILE_RANGE_64") != 1 ||
		src.logCount("would not serve") != 0 {
		t.Errorf("source's log of the save:\n%s", src.Tail(10))
	}

	t.Run("ours", func(t *testing.T) {
		dst, ddev := destination(t, src)
		c := load(t, ddev, state)
		if dst.logCount("negotiated=7.45") != 1 {
			t.Errorf("no session at 7.45 restored:\n%s", dst.Tail(10))
		}
		if got := c.read(a, afh, 0, 20000); string(got) != string(data) {
			t.Fatal("read after the migration differs")
		}
		if n, err := c.copyRange(vmm.OpCopyFileRange64, a, afh, b, bfh, 1<<40); err != nil || n != uint64(len(data)) {
			t.Fatalf("COPY_FILE_RANGE_64 on the destination: %d %v", n, err)
		}
		c.UID, c.GID = vmm.InvalidUIDGID, vmm.InvalidUIDGID
		c.getattr(b)
		noViolations(t, ddev)
	})

	t.Run("rust 1.14", func(t *testing.T) {
		bin := rust114()
		if bin == "" {
			t.Skip("no Rust virtiofsd 1.14 (make test-deps)")
		}
		dir := t.TempDir()
		sock := filepath.Join(dir, "sock")
		p, err := launch.Spec{Bin: bin, Group: true, Log: filepath.Join(dir, "log"),
			Args: launch.Line{Kind: launch.Rust, Socket: sock, Share: src.dir,
				Extra: []string{"--sandbox", "none", "--seccomp", "none", "--log-level", "debug"}}.Args()}.Start()
		if err != nil {
			t.Fatal(err)
		}
		defer p.Stop(5 * time.Second)
		if err := p.WaitSocket(sock, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		o := migOpts()
		o.Ack = vmm.AckQEMU10
		dev, err := vmm.Connect(sock, withRings(o))
		if err != nil {
			t.Fatal(err)
		}
		defer dev.Close()
		if err := dev.Init(); err != nil {
			t.Fatal(err)
		}
		if _, err := dev.Conn.GetFeatures(); err != nil {
			t.Fatal(err)
		}
		c := load(t, dev, state)
		if got := c.read(a, afh, 0, 20000); string(got) != string(data) {
			t.Fatalf("read on the Rust daemon differs\n%s", p.Tail(20))
		}
		if _, err := c.copyRange(vmm.OpCopyFileRange64, a, afh, b, bfh, 1<<40); !errors.Is(err, syscall.ENOSYS) {
			t.Fatalf("COPY_FILE_RANGE_64 on the Rust daemon: %v, want ENOSYS", err)
		}
		if n, err := c.copyRange(vmm.OpCopyFileRange, a, afh, b, bfh, 0xfffff000); err != nil || n != uint64(len(data)) {
			t.Fatalf("COPY_FILE_RANGE on the Rust daemon: %d %v", n, err)
		}
		// ALLOW_IDMAP: the Rust daemon serves requests without ids.
		c.UID, c.GID = vmm.InvalidUIDGID, vmm.InvalidUIDGID
		c.getattr(b)
		if got, _ := os.ReadFile(filepath.Join(src.dir, "b")); string(got) != string(data) {
			t.Fatal("copy on the host differs")
		}
		if strings.Contains(p.Log(), "panicked") {
			t.Fatalf("Rust daemon log:\n%s", p.Tail(20))
		}
	})
}
