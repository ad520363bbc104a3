package fuse

import (
	"bytes"
	"encoding/binary"
	"errors"
	"slices"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// secCtxBody is one fuse_secctx entry as Linux lays it out
// (get_security_context): { u32 size; u32 padding }, the NUL-terminated
// name, the label, zeroes up to 8 bytes.
func secCtxBody(name, value string) []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(len(value)))
	b = binary.LittleEndian.AppendUint32(b, 0)
	b = append(append(append(b, name...), 0), value...)
	return append(b, make([]byte, align8(len(b))-len(b))...)
}

// secCtxExt is the whole extension: the header (size, nr_secctx) and the
// entries.
func secCtxExt(nr uint32, body []byte) []byte { return extRec(nr, body) }

func TestParseSecCtx(t *testing.T) {
	const label = "system_u:object_r:container_file_t:s0:c1,c2\x00" // SELinux sends its NUL
	good := secCtxBody("security.selinux", label)
	for _, tc := range []struct {
		name  string
		body  []byte
		nr    uint32
		want  *SecCtx
		errno syscall.Errno
	}{
		{"SELinux", good, 1, &SecCtx{Name: []byte("security.selinux"), Value: []byte(label)}, 0},
		{"Smack, no padding needed", secCtxBody("security.SMACK64", "_"), 1, &SecCtx{Name: []byte("security.SMACK64"), Value: []byte("_")}, 0},
		{"empty label", secCtxBody("security.x", ""), 1, &SecCtx{Name: []byte("security.x"), Value: []byte{}}, 0},
		{"no LSM: none", nil, 0, nil, 0},
		{"none with a body", make([]byte, 8), 0, nil, syscall.EINVAL},
		{"two contexts", append(slices.Clone(good), good...), 2, nil, syscall.EINVAL},
		{"one counted, two sent", append(slices.Clone(good), good...), 1, nil, syscall.EINVAL},
		{"short of the entry header", good[:4], 1, nil, syscall.EINVAL},
		{"no NUL after the name", append(binary.LittleEndian.AppendUint64(nil, 0), "security.selinux"...), 1, nil, syscall.EINVAL},
		{"name too long", secCtxBody("security."+string(bytes.Repeat([]byte("n"), 247)), "v"), 1, nil, syscall.EINVAL},
		{"empty name", secCtxBody("", "v"), 1, nil, syscall.EINVAL},
		{"prefix only", secCtxBody("security.", "v"), 1, nil, syscall.EINVAL},
		{"not the security namespace", secCtxBody("trusted.overlay.opaque", "y"), 1, nil, syscall.EINVAL},
		{"label past the body", setSize(secCtxBody("security.selinux", "abc"), 64), 1, nil, syscall.EINVAL},
		{"label size huge", setSize(secCtxBody("security.selinux", "abc"), 0xffffffff), 1, nil, syscall.EINVAL},
		{"label over XATTR_SIZE_MAX", secCtxBody("security.selinux", string(make([]byte, xattrSizeMax+1))), 1, nil, syscall.EINVAL},
		{"label shorter than sent (extra padding)", append(secCtxBody("security.selinux", "abc"), make([]byte, 8)...), 1, nil, syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, errno := parseSecCtx(tc.body, tc.nr)
			if errno != tc.errno {
				t.Fatalf("errno %v, want %v", errno, tc.errno)
			}
			if (got == nil) != (tc.want == nil) ||
				got != nil && (!bytes.Equal(got.Name, tc.want.Name) || !bytes.Equal(got.Value, tc.want.Value)) {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
	// The largest legal entry parses: a 255-byte name and a 64 KiB label.
	name := "security." + string(bytes.Repeat([]byte("n"), xattrNameMax-len("security.")))
	if sc, errno := parseSecCtx(secCtxBody(name, string(make([]byte, xattrSizeMax))), 1); errno != 0 || len(sc.Value) != xattrSizeMax {
		t.Fatalf("largest context: %v", errno)
	}
}

// FuzzSecCtx: the decoder never panics, and what it accepts lies within
// the body, is named in the security namespace with at most
// XATTR_NAME_MAX bytes and no NUL, and fills the body to within padding.
func FuzzSecCtx(f *testing.F) {
	f.Add(secCtxBody("security.selinux", "system_u:object_r:s0\x00"), uint32(1))
	f.Add([]byte{}, uint32(0))
	f.Add(secCtxBody("security.SMACK64", ""), uint32(1))
	f.Add(setSize(secCtxBody("security.x", "y"), 0xfffffff0), uint32(1))
	f.Fuzz(func(t *testing.T, body []byte, nr uint32) {
		sc, errno := parseSecCtx(body, nr)
		if errno != 0 {
			if sc != nil {
				t.Fatal("a context with an error")
			}
			return
		}
		if sc == nil {
			if nr != 0 || len(body) != 0 {
				t.Fatalf("none accepted for nr %d, %d bytes", nr, len(body))
			}
			return
		}
		if nr != 1 || !bytes.HasPrefix(sc.Name, []byte("security.")) || len(sc.Name) > xattrNameMax ||
			bytes.IndexByte(sc.Name, 0) >= 0 || len(sc.Value) > xattrSizeMax {
			t.Fatalf("accepted %q (%d-byte label) for nr %d", sc.Name, len(sc.Value), nr)
		}
		if used := 8 + len(sc.Name) + 1 + len(sc.Value); align8(used) != len(body) ||
			int(binary.LittleEndian.Uint32(body)) != len(sc.Value) || !bytes.Equal(body[8:8+len(sc.Name)], sc.Name) {
			t.Fatalf("context %q does not describe the %d-byte body", sc.Name, len(body))
		}
	})
}

// secSession is a session whose file system asks for FUSE_SECURITY_CTX,
// which the Linux 6.1 INIT of newSession offers.
func secSession(t *testing.T) (*fakeFS, *Queue) {
	fs := newFakeFS()
	fs.caps |= gofuse.CAP_SECURITY_CTX
	s, q := newSession(t, fs)
	if ss, ok := s.Session(); !ok || ss.Caps&gofuse.CAP_SECURITY_CTX == 0 {
		t.Fatalf("SECURITY_CTX not negotiated: %+v", ss)
	}
	return fs, q
}

// TestSecCtxExtension: with SECURITY_CTX negotiated the context of each
// creation request reaches the file system, alone or after a
// supplementary group; the empty header a guest without an LSM sends
// means none; a malformed or repeated one is EINVAL before the file
// system sees the request; and the next request carries none.
func TestSecCtxExtension(t *testing.T) {
	fs, q := secSession(t)
	sel := secCtxExt(1, secCtxBody("security.selinux", "u:r:t:s0\x00"))
	mkdir := argBytes(gofuse.MkdirIn{Mode: 0o755}, 8)
	mknod := argBytes(gofuse.MknodIn{Mode: syscall.S_IFIFO | 0o644}, 16)
	create := argBytes(gofuse.CreateIn{Flags: syscall.O_WRONLY, Mode: 0o644}, 16)
	for _, tc := range []struct {
		name   string
		req    []byte
		op     string
		names  []string
		group  uint64
		errno  syscall.Errno
		called bool
	}{
		{"MKDIR", withExt(mkreq(OpMkdir, 2, mkdir, []string{"d"}, nil), sel), "Mkdir", []string{"d", "security.selinux=u:r:t:s0\x00"}, uint64(NoGroup), 0, true},
		{"MKNOD", withExt(mkreq(OpMknod, 4, mknod, []string{"p"}, nil), sel), "Mknod", []string{"p", "security.selinux=u:r:t:s0\x00"}, uint64(NoGroup), 0, true},
		{"SYMLINK", withExt(mkreq(OpSymlink, 6, nil, []string{"l", "t"}, nil), sel), "Symlink", []string{"t", "l", "security.selinux=u:r:t:s0\x00"}, uint64(NoGroup), 0, true},
		{"CREATE", withExt(mkreq(OpCreate, 8, create, []string{"f"}, nil), sel), "Create", []string{"f", "security.selinux=u:r:t:s0\x00"}, uint64(NoGroup), 0, true},
		{"TMPFILE", withExt(mkreq(OpTmpfile, 10, create, nil, nil), sel), "Tmpfile", []string{"security.selinux=u:r:t:s0\x00"}, uint64(NoGroup), 0, true},
		{"group then context", withExt(mkreq(OpMkdir, 12, mkdir, []string{"d"}, nil), append(groupsExt(1, 77), sel...)), "Mkdir",
			[]string{"d", "security.selinux=u:r:t:s0\x00"}, 77, 0, true},
		{"context then group", withExt(mkreq(OpMkdir, 14, mkdir, []string{"d"}, nil), append(slices.Clone(sel), groupsExt(1, 78)...)), "Mkdir",
			[]string{"d", "security.selinux=u:r:t:s0\x00"}, 78, 0, true},
		{"no LSM: empty header", withExt(mkreq(OpMkdir, 16, mkdir, []string{"d"}, nil), secCtxExt(0, nil)), "Mkdir", []string{"d"}, uint64(NoGroup), 0, true},
		{"none at all", mkreq(OpMkdir, 18, mkdir, []string{"d"}, nil), "Mkdir", []string{"d"}, uint64(NoGroup), 0, true},
		{"twice", withExt(mkreq(OpMkdir, 20, mkdir, []string{"d"}, nil), append(slices.Clone(sel), sel...)), "", nil, 0, syscall.EINVAL, false},
		{"empty header twice", withExt(mkreq(OpMkdir, 22, mkdir, []string{"d"}, nil), append(secCtxExt(0, nil), secCtxExt(0, nil)...)), "", nil, 0, syscall.EINVAL, false},
		{"two contexts", withExt(mkreq(OpMkdir, 24, mkdir, []string{"d"}, nil), secCtxExt(2, append(secCtxBody("security.a", "1"), secCtxBody("security.b", "2")...))), "", nil, 0, syscall.EINVAL, false},
		{"bad name", withExt(mkreq(OpMkdir, 26, mkdir, []string{"d"}, nil), secCtxExt(1, secCtxBody("user.x", "1"))), "", nil, 0, syscall.EINVAL, false},
		{"label past the extension", withExt(mkreq(OpMkdir, 28, mkdir, []string{"d"}, nil), secCtxExt(1, setSize(secCtxBody("security.x", "1"), 9))), "", nil, 0, syscall.EINVAL, false},
		{"count 31 (FUSE_MAX_NR_SECCTX)", withExt(mkreq(OpMkdir, 30, mkdir, []string{"d"}, nil), secCtxExt(31, secCtxBody("security.x", "1"))), "", nil, 0, syscall.EINVAL, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs.mu.Lock()
			fs.calls = nil
			fs.mu.Unlock()
			r := serve(t, q, tc.req, 0, 16+entryOutSize+openOutSize, 0)
			if got := syscall.Errno(-int32(binary.LittleEndian.Uint32(r[4:]))); got != tc.errno {
				t.Fatalf("errno %v, want %v", got, tc.errno)
			}
			calls := fs.lastCalls()
			if !tc.called {
				if len(calls) != 0 {
					t.Fatalf("the file system saw %+v", calls)
				}
				return
			}
			if len(calls) != 1 || calls[0].Op != tc.op || !slices.Equal(calls[0].Names, tc.names) ||
				!slices.Equal(calls[0].Args, []uint64{tc.group}) {
				t.Fatalf("calls %+v, want %s %q group %d", calls, tc.op, tc.names, tc.group)
			}
		})
	}
}

// TestSecCtxNotNegotiated: a session without SECURITY_CTX (the file
// system did not ask for it, or the guest did not offer it) refuses the
// extension, as any unknown one.
func TestSecCtxNotNegotiated(t *testing.T) {
	fs := newFakeFS()
	_, q := newSession(t, fs)
	req := withExt(mkreq(OpMkdir, 2, argBytes(gofuse.MkdirIn{Mode: 0o755}, 8), []string{"d"}, nil), secCtxExt(0, nil))
	r := serve(t, q, req, 0, 16+entryOutSize, 0)
	if got := syscall.Errno(-int32(binary.LittleEndian.Uint32(r[4:]))); got != syscall.EINVAL || len(fs.lastCalls()) != 0 {
		t.Fatalf("errno %v, calls %+v", got, fs.lastCalls())
	}
}

// TestNegotiator: the file system's Negotiate trims INIT's answer or
// refuses the session (EPROTO, no session).
func TestNegotiator(t *testing.T) {
	fs := newFakeFS()
	fs.caps |= gofuse.CAP_SECURITY_CTX
	var offered uint64
	fs.negotiate = func(o, caps uint64) (uint64, error) {
		offered = o
		return caps &^ gofuse.CAP_WRITEBACK_CACHE, nil
	}
	s := NewServer(fs, ServerOptions{}, debugLogger())
	q := s.Queue(1)
	r := serve(t, q, initReq(1, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)
	if len(r) != 80 || binary.LittleEndian.Uint32(r[4:]) != 0 {
		t.Fatalf("INIT: % x", r)
	}
	ss, _ := s.Session()
	if offered != uint64(kernelInitFlags)|uint64(kernelInitFlags2)<<32 || ss.Caps&gofuse.CAP_WRITEBACK_CACHE != 0 ||
		ss.Caps&gofuse.CAP_SECURITY_CTX == 0 {
		t.Fatalf("offered %#x, session %#x", offered, ss.Caps)
	}
	fs.negotiate = func(uint64, uint64) (uint64, error) { return 0, errors.New("required") }
	r = serve(t, q, initReq(3, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)
	if got := syscall.Errno(-int32(binary.LittleEndian.Uint32(r[4:]))); got != syscall.EPROTO {
		t.Fatalf("refused INIT: errno %v", got)
	}
	if _, ok := s.Session(); ok {
		t.Fatal("a session after a refused INIT")
	}
}
