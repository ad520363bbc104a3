package fuse

import (
	"encoding/binary"
	"slices"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

const testWindow = 64 << 20

func setupArgs(fh, foffset, length, flags, moffset uint64) []byte {
	b := make([]byte, setupMappingInSize)
	le := binary.LittleEndian
	le.PutUint64(b[0:], fh)
	le.PutUint64(b[8:], foffset)
	le.PutUint64(b[16:], length)
	le.PutUint64(b[24:], flags)
	le.PutUint64(b[32:], moffset)
	return b
}

// removeArgs is fuse_removemapping_in with count, then the entries (pairs
// of moffset, len).
func removeArgs(count uint32, entries ...uint64) []byte {
	b := make([]byte, 4, 4+8*len(entries))
	binary.LittleEndian.PutUint32(b, count)
	for _, v := range entries {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	return b
}

func TestDecodeSetupMapping(t *testing.T) {
	const two = 2 << 20
	rw := uint64(SetupMappingRead | SetupMappingWrite)
	for _, tc := range []struct {
		name                             string
		fh, foff, length, flags, moffset uint64
		short                            bool
		want                             syscall.Errno
	}{
		{name: "linux read slot", fh: ^uint64(0), foff: 4 * two, length: two, flags: SetupMappingRead, moffset: 3 * two},
		{name: "linux write slot", fh: ^uint64(0), length: two, flags: rw, moffset: testWindow - two},
		{name: "one page", foff: 4096, length: 4096, moffset: 8192},
		{name: "flags 0", length: 4096},
		{name: "short", length: two, short: true, want: syscall.EINVAL},
		{name: "unknown flag", length: two, flags: 4 | SetupMappingRead, want: syscall.EINVAL},
		{name: "high flag", length: two, flags: 1 << 63, want: syscall.EINVAL},
		{name: "len 0", length: 0, want: syscall.EINVAL},
		{name: "len unaligned", length: 4097, want: syscall.EINVAL},
		{name: "moffset unaligned", length: 4096, moffset: 512, want: syscall.EINVAL},
		{name: "foffset unaligned", foff: 1, length: 4096, want: syscall.EINVAL},
		{name: "past window", length: two, moffset: testWindow - 4096, want: syscall.EINVAL},
		{name: "moffset at end", length: 4096, moffset: testWindow, want: syscall.EINVAL},
		{name: "moffset huge", length: 4096, moffset: ^uint64(0) &^ 4095, want: syscall.EINVAL},
		{name: "moffset+len wraps", length: ^uint64(0) &^ 4095, moffset: 8192, want: syscall.EINVAL},
		{name: "len past window", length: testWindow + 4096, want: syscall.EINVAL},
		{name: "whole window", length: testWindow},
		{name: "foffset+len past off_t", foff: 1<<63 - 4096, length: 8192, want: syscall.EFBIG},
		{name: "foffset+len wraps", foff: ^uint64(0) &^ 4095, length: 8192, want: syscall.EFBIG},
		{name: "foffset at off_t end", foff: 1<<63 - 8192, length: 8192},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setupArgs(tc.fh, tc.foff, tc.length, tc.flags, tc.moffset)
			if tc.short {
				b = b[:setupMappingInSize-1]
			}
			a, errno := decodeSetupMapping(b, testWindow)
			if errno != tc.want {
				t.Fatalf("errno %v, want %v", errno, tc.want)
			}
			if errno == 0 && (a != SetupMappingIn{tc.fh, tc.foff, tc.length, tc.flags, tc.moffset}) {
				t.Fatalf("decoded %+v", a)
			}
		})
	}
}

func TestDecodeRemoveMapping(t *testing.T) {
	const two = 2 << 20
	many := make([]uint64, 0, 2*(MaxRemoveMappings+1))
	for k := range MaxRemoveMappings + 1 {
		many = append(many, uint64(k%32)*two, two)
	}
	for _, tc := range []struct {
		name    string
		count   uint32
		entries []uint64
		cut     int // bytes cut off the entries
		want    syscall.Errno
	}{
		{name: "one", count: 1, entries: []uint64{0, two}},
		{name: "two", count: 2, entries: []uint64{0, two, testWindow - two, two}},
		{name: "extra bytes ignored", count: 1, entries: []uint64{0, two, 77, 88}},
		{name: "max", count: MaxRemoveMappings, entries: many[:2*MaxRemoveMappings]},
		{name: "over max", count: MaxRemoveMappings + 1, entries: many, want: syscall.EINVAL},
		{name: "count 0", count: 0, entries: []uint64{0, two}, want: syscall.EINVAL},
		{name: "count past request", count: 2, entries: []uint64{0, two}, want: syscall.EINVAL},
		{name: "entry cut", count: 1, entries: []uint64{0, two}, cut: 1, want: syscall.EINVAL},
		{name: "count huge", count: ^uint32(0), entries: []uint64{0, two}, want: syscall.EINVAL},
		{name: "len 0", count: 1, entries: []uint64{0, 0}, want: syscall.EINVAL},
		{name: "unaligned", count: 1, entries: []uint64{100, two}, want: syscall.EINVAL},
		{name: "past window", count: 1, entries: []uint64{testWindow, two}, want: syscall.EINVAL},
		{name: "wraps", count: 1, entries: []uint64{two, ^uint64(0) &^ 4095}, want: syscall.EINVAL},
		{name: "second bad", count: 2, entries: []uint64{0, two, 1, two}, want: syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := removeArgs(tc.count, tc.entries...)[4:]
			b = b[:len(b)-tc.cut]
			var ranges [MaxRemoveMappings]MapRange
			n, errno := decodeRemoveMapping(tc.count, b, testWindow, ranges[:])
			if errno != tc.want || errno == 0 && n != int(tc.count) {
				t.Fatalf("got %d, %v; want %v", n, errno, tc.want)
			}
			for k := range n {
				if r := ranges[k]; r.Moffset != tc.entries[2*k] || r.Len != tc.entries[2*k+1] {
					t.Fatalf("entry %d: %+v, want %v", k, r, tc.entries[2*k:2*k+2])
				}
			}
		})
	}
}

// daxSession starts a session with a fake file system that has a window of
// window bytes, INIT offering flags and flags2, and returns the queue and
// the INIT reply.
func daxSession(t *testing.T, window uint64, flags, flags2 uint32) (*fakeFS, *Queue, gofuse.InitOut) {
	t.Helper()
	fs := newFakeFS()
	fs.window = window
	q := NewServer(fs, ServerOptions{}, debugLogger()).Queue(0)
	r := serve(t, q, initReq(1, 7, 45, flags, flags2, 64), 0, 80, 0)
	if errnoOf(r) != 0 || len(r) != 80 {
		t.Fatalf("INIT: % x", r)
	}
	var o gofuse.InitOut
	o.Flags = binary.LittleEndian.Uint32(r[OutHeaderSize+12:])
	o.MapAlignment = binary.LittleEndian.Uint16(r[OutHeaderSize+30:])
	o.Flags2 = binary.LittleEndian.Uint32(r[OutHeaderSize+32:])
	fs.mu.Lock()
	fs.calls = nil
	fs.mu.Unlock()
	return fs, q, o
}

func TestDAXInit(t *testing.T) {
	all := uint32(gofuse.CAP_INIT_EXT | gofuse.CAP_MAP_ALIGNMENT)
	inodeDAX := uint32(gofuse.CAP_HAS_INODE_DAX >> 32)
	for _, tc := range []struct {
		name          string
		window        uint64
		flags, flags2 uint32
		align         bool
		inode         bool
	}{
		{name: "window, all offered", window: testWindow, flags: all, flags2: inodeDAX, align: true, inode: true},
		{name: "no window", window: 0, flags: all, flags2: inodeDAX},
		{name: "window, nothing offered", window: testWindow, flags: gofuse.CAP_INIT_EXT},
		{name: "window, alignment only", window: testWindow, flags: all, align: true},
		{name: "window, inode dax only", window: testWindow, flags: gofuse.CAP_INIT_EXT, flags2: inodeDAX, inode: true},
		{name: "window, flags2 without INIT_EXT", window: testWindow, flags: gofuse.CAP_MAP_ALIGNMENT, flags2: inodeDAX, align: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, o := daxSession(t, tc.window, tc.flags, tc.flags2)
			if got := o.Flags&gofuse.CAP_MAP_ALIGNMENT != 0; got != tc.align {
				t.Errorf("MAP_ALIGNMENT %v, want %v", got, tc.align)
			}
			if got := o.MapAlignment; (got == MapAlignment) != tc.align || got != 0 && got != MapAlignment {
				t.Errorf("map_alignment %d", got)
			}
			if got := o.Flags2&inodeDAX != 0; got != tc.inode {
				t.Errorf("HAS_INODE_DAX %v, want %v", got, tc.inode)
			}
		})
	}
}

// TestDAXServe sends SETUPMAPPING and REMOVEMAPPING, good and hostile,
// through the server: only the good reach the file system.
func TestDAXServe(t *testing.T) {
	const two = 2 << 20
	rd := uint64(SetupMappingRead)
	for _, tc := range []struct {
		name   string
		window uint64
		op     uint32
		args   []byte
		want   syscall.Errno
		calls  [][]uint64 // the file system's calls' arguments
	}{
		{name: "setup", window: testWindow, op: OpSetupMapping, args: setupArgs(^uint64(0), two, two, rd, two),
			calls: [][]uint64{{^uint64(0), two, two, rd, two}}},
		{name: "setup no window", op: OpSetupMapping, args: setupArgs(^uint64(0), 0, two, rd, 0), want: syscall.ENOSYS},
		{name: "setup short no window", op: OpSetupMapping, args: make([]byte, 3), want: syscall.ENOSYS},
		{name: "setup short", window: testWindow, op: OpSetupMapping, args: setupArgs(0, 0, two, rd, 0)[:39], want: syscall.EINVAL},
		{name: "setup past window", window: testWindow, op: OpSetupMapping, args: setupArgs(0, 0, two, rd, testWindow), want: syscall.EINVAL},
		{name: "setup bad flags", window: testWindow, op: OpSetupMapping, args: setupArgs(0, 0, two, 8, 0), want: syscall.EINVAL},
		{name: "setup unaligned foffset", window: testWindow, op: OpSetupMapping, args: setupArgs(0, 100, two, rd, 0), want: syscall.EINVAL},
		{name: "remove", window: testWindow, op: OpRemoveMapping, args: removeArgs(2, 0, two, two, two),
			calls: [][]uint64{{0, two, two, two}}},
		{name: "remove no window", op: OpRemoveMapping, args: removeArgs(1, 0, two), want: syscall.ENOSYS},
		{name: "remove count 0", window: testWindow, op: OpRemoveMapping, args: removeArgs(0, 0, two), want: syscall.EINVAL},
		{name: "remove count past", window: testWindow, op: OpRemoveMapping, args: removeArgs(3, 0, two, two, two), want: syscall.EINVAL},
		{name: "remove short", window: testWindow, op: OpRemoveMapping, args: []byte{1, 0}, want: syscall.EINVAL},
		{name: "remove second bad: none removed", window: testWindow, op: OpRemoveMapping,
			args: removeArgs(2, 0, two, testWindow, two), want: syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs, q, _ := daxSession(t, tc.window, kernelInitFlags, kernelInitFlags2)
			r := serve(t, q, mkreq(tc.op, 9, tc.args, nil, nil), 0, 64, 0)
			if errnoOf(r) != -int32(tc.want) || len(r) != OutHeaderSize {
				t.Fatalf("reply % x, want errno %v", r, tc.want)
			}
			fs.mu.Lock()
			defer fs.mu.Unlock()
			if len(fs.calls) != len(tc.calls) {
				t.Fatalf("calls %+v, want %v", fs.calls, tc.calls)
			}
			for k, c := range fs.calls {
				if len(c.Args) != len(tc.calls[k]) {
					t.Fatalf("call %d: %+v, want %v", k, c, tc.calls[k])
				}
				for j := range c.Args {
					if c.Args[j] != tc.calls[k][j] {
						t.Fatalf("call %d: %+v, want %v", k, c, tc.calls[k])
					}
				}
				if c.Op == "SetupMapping" && c.In.(gofuse.InHeader).NodeId != testNode {
					t.Fatalf("call %d: node %d", k, c.In.(gofuse.InHeader).NodeId)
				}
			}
		})
	}
}

// TestDAXRemoveOneCall: a REMOVEMAPPING reaches the file system as one
// call with all its entries, and the file system's answer is the reply.
func TestDAXRemoveOneCall(t *testing.T) {
	fs, q, _ := daxSession(t, testWindow, kernelInitFlags, kernelInitFlags2)
	fs.errno = syscall.EINVAL
	r := serve(t, q, mkreq(OpRemoveMapping, 9, removeArgs(2, 0, 4096, 8192, 4096), nil, nil), 0, 64, 0)
	if errnoOf(r) != -int32(syscall.EINVAL) {
		t.Fatalf("reply % x", r)
	}
	if c := fs.lastCalls(); len(c) != 1 || !slices.Equal(c[0].Args, []uint64{0, 4096, 8192, 4096}) {
		t.Fatalf("calls %+v", c)
	}
}

// FuzzSetupMapping: whatever the bytes, an accepted request names a
// non-empty, page-aligned range inside the window, a page-aligned file
// offset whose range fits an off_t, and only READ and WRITE.
func FuzzSetupMapping(f *testing.F) {
	f.Add(setupArgs(^uint64(0), 0, 2<<20, SetupMappingRead, 0), uint64(testWindow))
	f.Add(setupArgs(0, 1<<63-4096, 4096, 3, testWindow-4096), uint64(testWindow))
	f.Add(setupArgs(0, 0, 4096, 4, 0), uint64(0))
	f.Add([]byte{1, 2, 3}, uint64(4096))
	f.Fuzz(func(t *testing.T, b []byte, window uint64) {
		a, errno := decodeSetupMapping(b, window)
		if errno != 0 {
			return
		}
		switch {
		case len(b) < setupMappingInSize:
			t.Fatalf("accepted %d bytes", len(b))
		case a.Flags&^3 != 0:
			t.Fatalf("flags %#x", a.Flags)
		case a.Len == 0 || a.Len%4096 != 0 || a.Moffset%4096 != 0 || a.Foffset%4096 != 0:
			t.Fatalf("unaligned %+v", a)
		case a.Moffset+a.Len < a.Moffset || a.Moffset+a.Len > window:
			t.Fatalf("outside the window %d: %+v", window, a)
		case a.Foffset+a.Len < a.Foffset || a.Foffset+a.Len > 1<<63:
			t.Fatalf("file range %+v", a)
		}
	})
}

// FuzzRemoveMapping: an accepted REMOVEMAPPING has 1..MaxRemoveMappings
// entries, all inside the request and each a good range of the window; and
// through the server, the file system sees exactly those.
func FuzzRemoveMapping(f *testing.F) {
	f.Add(removeArgs(1, 0, 2<<20), uint64(testWindow))
	f.Add(removeArgs(2, 0, 4096, testWindow-4096, 4096), uint64(testWindow))
	f.Add(removeArgs(0), uint64(testWindow))
	f.Add(removeArgs(^uint32(0), 1, 2), uint64(4096))
	f.Fuzz(func(t *testing.T, b []byte, window uint64) {
		if len(b) < 4 {
			return
		}
		count := binary.LittleEndian.Uint32(b)
		var ranges [MaxRemoveMappings]MapRange
		n, errno := decodeRemoveMapping(count, b[4:], window, ranges[:])
		if errno == 0 {
			if n < 1 || n > MaxRemoveMappings || n*removeMappingOne > len(b)-4 {
				t.Fatalf("accepted count %d of %d bytes", n, len(b))
			}
			for k, r := range ranges[:n] {
				m, l := r.Moffset, r.Len
				if l == 0 || l%4096 != 0 || m%4096 != 0 || m+l < m || m+l > window {
					t.Fatalf("entry %d: %d, %d", k, m, l)
				}
			}
		}
		// Through the server, with a window of the fuzzed size rounded
		// to what a daemon would have.
		fs := newFakeFS()
		fs.window = window &^ 4095
		q := NewServer(fs, ServerOptions{}, quietLogger()).Queue(0)
		serve(t, q, initReq(1, 7, 45, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)
		fs.calls = nil
		serve(t, q, mkreq(OpRemoveMapping, 2, b, nil, nil), 0, 64, 0)
		want, _ := decodeRemoveMapping(count, b[4:], fs.window, ranges[:])
		switch c := fs.lastCalls(); {
		case want == 0 && len(c) != 0:
			t.Fatalf("calls %+v for a refused request", c)
		case want > 0 && (len(c) != 1 || len(c[0].Args) != 2*want):
			t.Fatalf("calls %+v, want one of %d entries", c, want)
		}
	})
}
