package fuse

import (
	"encoding/binary"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// FuzzServe feeds arbitrary readable bytes, cut into fuzz-chosen segment
// sizes, and an arbitrary writable size through the server with a fake file
// system, in a session INIT started (or not): it must never panic, never
// write past the writable space, and a non-zero reply length must fit the
// writable space and equal out.len (checked by serve). With fixLen the
// header's length is set to the request's, so that the fuzzer reaches the
// argument decoders more often.
func FuzzServe(f *testing.F) {
	f.Add(initReq(2, 7, 38, kernelInitFlags, kernelInitFlags2, 64), uint16(80), uint8(40), uint8(0), false, false)
	f.Add(header(OpForget, 0, 48), uint16(0), uint8(0), uint8(0), true, false)
	f.Add([]byte{1, 2, 3}, uint16(16), uint8(1), uint8(1), true, true)
	for i, tc := range opCases() {
		req := mkreq(tc.op, uint64(i), tc.args, tc.names, tc.raw)
		if tc.ext != nil {
			// Seeds with request extensions (supplementary groups,
			// malformed areas).
			req = withExt(req, tc.ext)
		}
		f.Add(req, uint16(4096), uint8(i%9), uint8(i%5), true, true)
	}
	// A creation with a security context, and one with a group too.
	mkdir := mkreq(OpMkdir, 3, argBytes(gofuse.MkdirIn{Mode: 0o755}, 8), []string{"d"}, nil)
	sel := secCtxExt(1, secCtxBody("security.selinux", "u:r:t:s0\x00"))
	f.Add(withExt(mkdir, sel), uint16(4096), uint8(3), uint8(0), true, true)
	f.Add(withExt(mkdir, append(groupsExt(1, 5), sel...)), uint16(4096), uint8(0), uint8(2), true, true)
	f.Fuzz(func(t *testing.T, req []byte, outSize uint16, inK, outK uint8, session, fixLen bool) {
		if fixLen && len(req) >= 4 {
			binary.LittleEndian.PutUint32(req, uint32(len(req)))
		}
		fs := newFakeFS()
		fs.caps |= gofuse.CAP_SECURITY_CTX // the session parses security contexts
		fs.dirents = testDirents
		if outK%2 == 1 {
			fs.window = testWindow // SETUPMAPPING, REMOVEMAPPING served
		}
		var q *Queue
		if session {
			_, q = newSession(t, fs)
		} else {
			q = NewServer(fs, ServerOptions{}, debugLogger()).Queue(1)
		}
		checkClassify(t, q, req, int(inK))
		serve(t, q, req, int(inK), int(outSize), int(outK))
		// The queue stays usable after whatever came before.
		r := serve(t, q, mkreq(OpStatfs, 99, nil, nil, nil), 0, 16+statfsOutSize, 0)
		if len(r) != 16 && len(r) != 16+statfsOutSize {
			t.Fatalf("STATFS after the fuzzed request: % x", r)
		}
	})
}

// checkClassify: Classify never consumes the request, and says only what the
// header's opcode allows.
func checkClassify(t *testing.T, q *Queue, req []byte, inK int) {
	in := vecOf(req)
	if inK > 0 {
		in = chunked(req, inK)
	}
	heavy, node, slow := q.Classify(in)
	if in.Pos() != 0 {
		t.Fatalf("Classify left the cursor at %d", in.Pos())
	}
	var op uint32
	if len(req) >= InHeaderSize {
		op = binary.LittleEndian.Uint32(req[4:])
	}
	if heavy && op != OpRead && op != OpWrite || node != 0 && op != OpWrite || heavy && slow {
		t.Fatalf("Classify(op %d) = %v, %d, %v", op, heavy, node, slow)
	}
	switch op {
	case OpFsync, OpFsyncdir, OpFlush, OpFallocate, OpCopyFileRange, OpCopyFileRange64, OpSyncfs,
		OpSetupMapping, OpRemoveMapping:
		if !slow {
			t.Fatalf("Classify(op %d) not slow", op)
		}
	default:
		if slow {
			t.Fatalf("Classify(op %d) slow", op)
		}
	}
}
