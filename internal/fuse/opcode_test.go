package fuse

import "testing"

// The table's sizes fit what decode reads the arguments into and the reply
// buffer; every opcode served has a name, and one without a reply no
// reply payload.
func TestOpcodeTable(t *testing.T) {
	args := len(request{}.args)
	if initInSize > args || setxattrExtSize > args {
		t.Errorf("arguments of %d bytes hold neither fuse_init_in nor fuse_setxattr_in", args)
	}
	for op, o := range opcodes {
		switch {
		case op == 0 && (o.name != "" || o.serve != nil || o.flags != 0):
			t.Errorf("entry 0 (unknown opcodes) is %+v", o)
		case int(o.in) > args:
			t.Errorf("%s: %d bytes of arguments, more than %d", o.name, o.in, args)
		case OutHeaderSize+int(o.out) > replyBufSize:
			t.Errorf("%s: a reply of %d bytes, more than the %d of rbuf", o.name, o.out, replyBufSize)
		case o.serve != nil && o.name == "":
			t.Errorf("opcode %d served without a name", op)
		case o.flags&silent != 0 && o.out != 0:
			t.Errorf("%s: silent with a reply payload", o.name)
		}
	}
}
