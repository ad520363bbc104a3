package passthrough

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// testFS is a file system over a fresh temp directory, with INIT done.
type testFS struct {
	*FS
	t    *testing.T
	dir  string // the shared directory on the host
	base string // its parent (outside the share)
	// baseFDs is the inode fds held with no guest lookups (the root, and
	// its mount fd in file handle mode).
	baseFDs int
}

// testLog is the file systems' logger in tests: what they log is not
// asserted.
var testLog = slog.New(slog.DiscardHandler)

func newTestFS(t *testing.T, opts Options) *testFS {
	t.Helper()
	base := t.TempDir()
	dir := filepath.Join(base, "share")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tf := openTestFS(t, dir, base, opts)
	tf.Init(tf.Capabilities())
	return tf
}

// openTestFS returns a fresh file system over dir (in base), closed when
// the test ends; INIT is not done.
func openTestFS(t *testing.T, dir, base string, opts Options) *testFS {
	t.Helper()
	if opts.InodeFileHandles == FileHandlesNever && os.Getenv("PT_FILE_HANDLES") == "prefer" {
		opts.InodeFileHandles = FileHandlesPrefer
	}
	if b, err := strconv.Atoi(os.Getenv("PT_FD_BUDGET")); err == nil && opts.InodeFDBudget == 0 {
		opts.InodeFDBudget = b
	}
	f, err := New(dir, opts, testLog)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return &testFS{FS: f, t: t, dir: dir, base: base, baseFDs: f.Stats().InodeFDs}
}

func (tf *testFS) path(rel string) string { return filepath.Join(tf.dir, rel) }

func hdr(node uint64) *gofuse.InHeader {
	return &gofuse.InHeader{NodeId: node}
}

func hdrAs(node uint64, uid, gid uint32) *gofuse.InHeader {
	h := hdr(node)
	h.Uid, h.Gid = uid, gid
	return h
}

func (tf *testFS) lookup(parent uint64, name string) gofuse.EntryOut {
	tf.t.Helper()
	var out gofuse.EntryOut
	if errno := tf.Lookup(hdr(parent), []byte(name), &out); errno != 0 {
		tf.t.Fatalf("lookup %q in %d: %v", name, parent, errno)
	}
	return out
}

func (tf *testFS) lookupErr(parent uint64, name string) syscall.Errno {
	var out gofuse.EntryOut
	errno := tf.Lookup(hdr(parent), []byte(name), &out)
	if errno == 0 {
		tf.Forget(out.NodeId, 1)
	}
	return errno
}

func (tf *testFS) open(node uint64, flags uint32) uint64 {
	tf.t.Helper()
	var out gofuse.OpenOut
	in := &gofuse.OpenIn{InHeader: *hdr(node), Flags: flags}
	if errno := tf.Open(in, &out); errno != 0 {
		tf.t.Fatalf("open %d: %v", node, errno)
	}
	return out.Fh
}

func (tf *testFS) create(parent uint64, name string, flags, mode uint32) gofuse.CreateOut {
	tf.t.Helper()
	var out gofuse.CreateOut
	in := &gofuse.CreateIn{InHeader: *hdr(parent), Flags: flags, Mode: mode}
	if errno := tf.Create(in, noGroup, nil, []byte(name), &out); errno != 0 {
		tf.t.Fatalf("create %q: %v", name, errno)
	}
	return out
}

func (tf *testFS) release(node, fh uint64) {
	tf.Release(&gofuse.ReleaseIn{InHeader: *hdr(node), Fh: fh})
}

func (tf *testFS) getattr(node uint64) gofuse.AttrOut {
	tf.t.Helper()
	var out gofuse.AttrOut
	if errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(node)}, &out); errno != 0 {
		tf.t.Fatalf("getattr %d: %v", node, errno)
	}
	return out
}

func vecOver(b []byte) *bufvec.Vec {
	v := bufvec.NewVec(4)
	if err := v.Append(bufvec.Segment{Buf: b, Len: uint32(len(b))}); err != nil {
		panic(err)
	}
	return v
}

func (tf *testFS) write(node, fh uint64, off uint64, data []byte, flags uint32) int {
	tf.t.Helper()
	in := &gofuse.WriteIn{InHeader: *hdr(node), Fh: fh, Offset: off, Size: uint32(len(data)), WriteFlags: flags}
	n, errno := tf.Write(in, vecOver(data))
	if errno != 0 {
		tf.t.Fatalf("write: %v", errno)
	}
	return n
}

func (tf *testFS) read(node, fh uint64, off uint64, size int) []byte {
	tf.t.Helper()
	buf := make([]byte, size)
	in := &gofuse.ReadIn{InHeader: *hdr(node), Fh: fh, Offset: off, Size: uint32(size)}
	n, errno := tf.Read(in, vecOver(buf))
	if errno != 0 {
		tf.t.Fatalf("read: %v", errno)
	}
	return buf[:n]
}

func (tf *testFS) mkdir(parent uint64, name string, mode uint32) gofuse.EntryOut {
	tf.t.Helper()
	var out gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(parent), Mode: mode}, noGroup, nil, []byte(name), &out); errno != 0 {
		tf.t.Fatalf("mkdir %q: %v", name, errno)
	}
	return out
}

func (tf *testFS) opendir(node uint64) uint64 {
	tf.t.Helper()
	var out gofuse.OpenOut
	if errno := tf.OpenDir(&gofuse.OpenIn{InHeader: *hdr(node)}, &out); errno != 0 {
		tf.t.Fatalf("opendir %d: %v", node, errno)
	}
	return out.Fh
}

type dirent struct {
	name  string
	ino   uint64
	typ   uint32
	off   uint64
	entry gofuse.EntryOut
}

// readdirAll lists a directory in chunks of at most perCall entries.
func (tf *testFS) readdirAll(node uint64, plus bool, perCall int) []dirent {
	tf.t.Helper()
	fh := tf.opendir(node)
	defer tf.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(node), Fh: fh})
	var all []dirent
	off := uint64(0)
	for {
		var got []*dirent
		var eo gofuse.EntryOut
		in := &gofuse.ReadIn{InHeader: *hdr(node), Fh: fh, Offset: off, Size: 4096}
		errno := tf.ReadDir(in, plus, func(name []byte, ino uint64, typ uint32, o uint64) (*gofuse.EntryOut, bool) {
			if len(got) > 0 && plus {
				got[len(got)-1].entry = eo
			}
			if len(got) == perCall {
				return nil, false
			}
			got = append(got, &dirent{name: string(name), ino: ino, typ: typ, off: o})
			eo = gofuse.EntryOut{}
			return &eo, true
		})
		if errno != 0 {
			tf.t.Fatalf("readdir: %v", errno)
		}
		if len(got) > 0 && plus {
			got[len(got)-1].entry = eo
		}
		if len(got) == 0 {
			return all
		}
		for _, d := range got {
			all = append(all, *d)
		}
		off = got[len(got)-1].off
	}
}

func statHost(t *testing.T, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// countingLog counts the records logged whose message contains a string.
type countingLog struct {
	mu   sync.Mutex
	msgs []string
}

func (c *countingLog) Enabled(context.Context, slog.Level) bool { return true }
func (c *countingLog) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.msgs = append(c.msgs, r.Message)
	return nil
}
func (c *countingLog) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *countingLog) WithGroup(string) slog.Handler      { return c }

func (c *countingLog) count(s string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, m := range c.msgs {
		if strings.Contains(m, s) {
			n++
		}
	}
	return n
}

// noGroup is the groups argument of a creation request that carried none.
var noGroup []uint32
