package passthrough

import (
	"bytes"
	"encoding/binary"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/fuse"
)

// fuseReq is a FUSE request: the header for op on node, then args.
func fuseReq(op uint32, unique, node uint64, args ...[]byte) []byte {
	b := make([]byte, fuse.InHeaderSize)
	for _, a := range args {
		b = append(b, a...)
	}
	le := binary.LittleEndian
	le.PutUint32(b[0:], uint32(len(b)))
	le.PutUint32(b[4:], op)
	le.PutUint64(b[8:], unique)
	le.PutUint64(b[16:], node)
	return b
}

func u64s(vs ...uint64) []byte {
	var b []byte
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	return b
}

// serveReq serves req and returns the reply's errno and payload.
func serveReq(t *testing.T, q *fuse.Queue, req []byte) (syscall.Errno, []byte) {
	t.Helper()
	out := make([]byte, 4096)
	n := q.Serve(vecOver(req), vecOver(out))
	if n < fuse.OutHeaderSize {
		t.Fatalf("no reply to opcode %d", binary.LittleEndian.Uint32(req[4:]))
	}
	return syscall.Errno(-int32(binary.LittleEndian.Uint32(out[4:]))), out[fuse.OutHeaderSize:n]
}

// TestDAXThroughServer: a guest's SETUPMAPPING and REMOVEMAPPING, good and
// hostile, through the FUSE server to the file system and the window.
func TestDAXThroughServer(t *testing.T) {
	w := newFakeWindow(t, win16M)
	tf := newTestFS(t, Options{Window: w})
	data := pattern(slot2M+10, 7)
	tf.mkfile("f", data)
	tf.mkdir(rootID, "d", 0o755)
	q := fuse.NewServer(tf.FS, fuse.ServerOptions{}, testLog).Queue(0)

	init := make([]byte, 64)
	le := binary.LittleEndian
	le.PutUint32(init[0:], 7)
	le.PutUint32(init[4:], 45)
	le.PutUint32(init[12:], gofuse.CAP_INIT_EXT|gofuse.CAP_MAP_ALIGNMENT)
	le.PutUint32(init[16:], uint32(gofuse.CAP_HAS_INODE_DAX>>32))
	errno, o := serveReq(t, q, fuseReq(fuse.OpInit, 1, 0, init))
	if errno != 0 || le.Uint16(o[30:]) != 12 || le.Uint32(o[12:])&gofuse.CAP_MAP_ALIGNMENT == 0 ||
		le.Uint32(o[32:])&uint32(gofuse.CAP_HAS_INODE_DAX>>32) == 0 {
		t.Fatalf("INIT: %v % x", errno, o)
	}
	errno, o = serveReq(t, q, fuseReq(fuse.OpLookup, 2, rootID, []byte("f\x00")))
	if errno != 0 {
		t.Fatal(errno)
	}
	node := le.Uint64(o)
	if le.Uint32(o[40+84:])&gofuse.ATTR_DAX == 0 { // fuse_entry_out's attr.flags
		t.Fatal("LOOKUP: no FUSE_ATTR_DAX")
	}
	errno, o = serveReq(t, q, fuseReq(fuse.OpLookup, 3, rootID, []byte("d\x00")))
	if errno != 0 {
		t.Fatal(errno)
	}
	dir := le.Uint64(o)
	errno, o = serveReq(t, q, fuseReq(fuse.OpOpen, 4, node, make([]byte, 8)))
	if errno != 0 {
		t.Fatal(errno)
	}
	fh := le.Uint64(o)

	setup := func(node, fh, foff, length, flags, moff uint64) syscall.Errno {
		errno, _ := serveReq(t, q, fuseReq(fuse.OpSetupMapping, 9, node, u64s(fh, foff, length, flags, moff)))
		return errno
	}
	remove := func(count uint32, entries ...uint64) syscall.Errno {
		c := make([]byte, 4)
		le.PutUint32(c, count)
		errno, _ := serveReq(t, q, fuseReq(fuse.OpRemoveMapping, 10, 0, c, u64s(entries...)))
		return errno
	}
	for _, tc := range []struct {
		name string
		got  syscall.Errno
		want syscall.Errno
	}{
		{"past the window", setup(node, noFH, 0, slot2M, rdMap, win16M), syscall.EINVAL},
		{"overflowing moffset", setup(node, noFH, 0, slot2M, rdMap, ^uint64(0)&^4095), syscall.EINVAL},
		{"unaligned moffset", setup(node, noFH, 0, slot2M, rdMap, 100), syscall.EINVAL},
		{"unaligned foffset", setup(node, noFH, 10, slot2M, rdMap, 0), syscall.EINVAL},
		{"len 0", setup(node, noFH, 0, 0, rdMap, 0), syscall.EINVAL},
		{"foffset overflow", setup(node, noFH, 1<<63, slot2M, rdMap, 0), syscall.EFBIG},
		{"bad flags", setup(node, noFH, 0, slot2M, 0x10, 0), syscall.EINVAL},
		{"crossing slots", setup(node, noFH, 0, slot2M, rdMap, 4096), syscall.EINVAL},
		{"unknown node", setup(777, noFH, 0, slot2M, rdMap, 0), syscall.EBADF},
		{"directory", setup(dir, noFH, 0, slot2M, rdMap, 0), syscall.EINVAL},
		{"foreign fh", setup(node, fh+1, 0, slot2M, rdMap, 0), syscall.EBADF},
		{"writable from a read-only open", setup(node, noFH, 0, slot2M, rwMap, 0), syscall.EACCES},
		{"remove count 0", remove(0, 0, slot2M), syscall.EINVAL},
		{"remove count past the request", remove(2, 0, slot2M), syscall.EINVAL},
		{"remove count huge", remove(1 << 31), syscall.EINVAL},
		{"remove past the window", remove(1, win16M, slot2M), syscall.EINVAL},
		{"remove unaligned", remove(1, 0, 100), syscall.EINVAL},
	} {
		if tc.got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, tc.got, tc.want)
		}
	}
	if w.mapCalls != 0 || len(w.live()) != 0 {
		t.Fatalf("a hostile request reached the window: %d calls", w.mapCalls)
	}
	// The good ones.
	if errno := setup(node, noFH, slot2M, slot2M, rdMap, 2*slot2M); errno != 0 {
		t.Fatal(errno)
	}
	if errno := setup(node, fh, 0, slot2M, rdMap, 0); errno != 0 {
		t.Fatal(errno)
	}
	if !bytes.Equal(w.guestView(0, slot2M), data[:slot2M]) || !bytes.Equal(w.guestView(2*slot2M, slot2M), want(data, slot2M, slot2M)) {
		t.Fatal("the guest sees other bytes")
	}
	// A REMOVEMAPPING whose second entry cuts a mapping: EINVAL, and
	// nothing removed, not even the first entry's mapping.
	if errno := remove(2, 2*slot2M, slot2M, 0, 4096); errno != syscall.EINVAL {
		t.Fatal(errno)
	}
	if n, _ := tf.MapStats(); n != 2 || !bytes.Equal(w.guestView(0, slot2M), data[:slot2M]) ||
		!bytes.Equal(w.guestView(2*slot2M, slot2M), want(data, slot2M, slot2M)) {
		t.Fatalf("%d mappings", n)
	}
	if errno := remove(2, 2*slot2M, slot2M, 0, slot2M); errno != 0 {
		t.Fatal(errno)
	}
	if n, fds := tf.MapStats(); n != 0 || fds != 0 || len(w.live()) != 0 {
		t.Fatalf("%d mappings, %d fds, %d live after REMOVEMAPPING", n, fds, len(w.live()))
	}
	// DESTROY unmaps everything.
	if errno := setup(node, noFH, 0, slot2M, rdMap, 0); errno != 0 {
		t.Fatal(errno)
	}
	before := w.unmapAll
	serveReq(t, q, fuseReq(fuse.OpDestroy, 11, 0))
	if n, _ := tf.MapStats(); n != 0 || w.unmapAll != before+1 || len(w.live()) != 0 {
		t.Fatalf("after DESTROY: %d mappings, %d live", n, len(w.live()))
	}
}
